-- The owner applies a reset or close control job from its inbox, fenced like a commit.
-- reset: committed -> -1, context 0, stored results dropped. close: the worker's load drops, the
-- log (stored results, the bulk) expires after the grace TTL and the small session hash after the
-- closed retention, so status and a second close still answer 'closed' for that long, as the
-- serving layer does (docs/architecture.md).
-- Uses: prelude.lua (fenced, add_reply, log_blobs)
-- KEYS: 1 session hash, 2 log hash, 3 inbox, 4 reply stream, 5 pool zset, 6 sessions hash, 7 owned hash,
--       8 trainer open hash (a close counts the session's trainer down, as it counts the owner down)
-- ARGV: 1 worker id, 2 job epoch, 3 inbox entry id, 4 job_id, 5 kind, 6 grace ttl ms,
--       7 reply ttl ms, 8 inbox group, 9 session_id, 10-12 reply stream bounds (ReplyBounds),
--       13 closed retention ms (the session hash's TTL after a close; the grace TTL when absent)
-- Fields (broker/redis/layouts.py): reads session owner, epoch, committed_step_id, reset_pending, trainer;
--       writes session committed_step_id, context_length, reset_pending (reset), drops first_version
--       (reset: the next committed step starts a new trajectory, docs/async_rl.md); drops the log
--       and its result blobs (reset; a close expires them with the log, prelude.lua log_blobs);
--       adds a reply entry (kind, job_id, committed, result '') unless job_id is '' (an idle close)
-- A reset that control.lua never enqueued (reset_pending 0: a forged or replayed entry) is refused
-- like a fenced job: applied, it would move committed to -1 while next_step_id stays put. A retry
-- of a call that went through (the entry is no longer in the inbox) changes nothing.
-- Returns {'applied', committed} | {'fenced', owner, epoch} | {'unrequested', committed}
local s = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'committed_step_id', 'reset_pending', 'trainer')
if s[1] and fenced(s[1], s[2], ARGV[1], ARGV[2]) then
  return {'fenced', s[1], s[2]}
end
local committed = tonumber(s[3] or '-1')
if #redis.call('XRANGE', KEYS[3], ARGV[3], ARGV[3]) == 0 then
  -- The entry is gone: this is the retry of a call that went through (its reply was lost).
  -- Applying again would count the reset or the close twice.
  return {'applied', committed}
end
if s[1] and ARGV[5] == 'reset' and s[4] == '0' then
  return {'unrequested', committed}
end
if s[1] then
  if ARGV[5] == 'reset' then
    committed = -1
    for _, blob in ipairs(log_blobs(KEYS[2])) do
      redis.call('DEL', blob)
    end
    redis.call('DEL', KEYS[2])
    local pending = tonumber(s[4] or '1') - 1
    if pending < 0 then pending = 0 end
    redis.call('HSET', KEYS[1], 'committed_step_id', -1, 'context_length', 0, 'reset_pending', pending)
    redis.call('HDEL', KEYS[1], 'first_version')
  else
    -- Only while the worker is in the pool: a draining or not-ready worker left it, and ZINCRBY
    -- would add it back at -1, the least-loaded place of all.
    if redis.call('ZSCORE', KEYS[5], ARGV[1]) then
      redis.call('ZINCRBY', KEYS[5], -1, ARGV[1])
    end
    if tonumber(redis.call('HGET', KEYS[7], ARGV[1]) or '0') > 0 then  -- never below 0, never revived
      redis.call('HINCRBY', KEYS[7], ARGV[1], -1)
    end
    -- A session created before trainers were counted has no trainer: nothing to count down.
    if s[5] and KEYS[8] and redis.call('HINCRBY', KEYS[8], s[5], -1) <= 0 then
      redis.call('HDEL', KEYS[8], s[5])  -- never below 0, and no field left per trainer gone
    end
    redis.call('HDEL', KEYS[6], ARGV[9])
    redis.call('PEXPIRE', KEYS[1], ARGV[13] or ARGV[6])
    for _, blob in ipairs(log_blobs(KEYS[2])) do
      redis.call('PEXPIRE', blob, ARGV[6])
    end
    redis.call('PEXPIRE', KEYS[2], ARGV[6])
  end
end
redis.call('XACK', KEYS[3], ARGV[8], ARGV[3])
redis.call('XDEL', KEYS[3], ARGV[3])
if ARGV[4] ~= '' then  -- an idle close (close_idle.lua) asks no reply
  add_reply(KEYS[4], ARGV[7], ARGV[10], ARGV[11], ARGV[12], ARGV[5], ARGV[4], committed, '')
end
return {'applied', committed}
