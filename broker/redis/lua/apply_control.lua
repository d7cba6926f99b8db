-- The owner applies a reset or close control job from its inbox, fenced like a commit.
-- reset: committed -> -1, context 0, stored results dropped. close: the worker's load drops, the
-- log (stored results, the bulk) expires after the grace TTL and the small session hash after the
-- closed retention, so status and a second close still answer 'closed' for that long, as the
-- serving layer does (docs/architecture.md).
-- Uses: prelude.lua (fenced, add_reply, log_blobs, hand_over_or, delete_key)
-- KEYS: 1 session hash, 2 log hash, 3 inbox, 4 reply stream, 5 pool zset, 6 sessions hash, 7 owned hash,
--       8 trainer open hash (a close counts the session's trainer down, as it counts the owner down)
-- Derived keys (docs/architecture.md, "Keys in Lua scripts"): the blobs the log hash refers to,
--       one per result field and input:<step> field its HKEYS lists (prelude.lua log_blobs): the
--       caller cannot know the steps the log holds; each is the log key's name plus a suffix, in
--       its hash tag and slot; so is each one's in-place marker (prelude.lua hand_over_or: a result
--       whose in-place reply is unread goes to its reader instead).
-- ARGV: 1 worker id, 2 job epoch, 3 inbox entry id, 4 job_id, 5 kind, 6 grace ttl ms,
--       7 reply ttl ms, 8 inbox group, 9 session_id, 10-12 reply stream bounds (ReplyBounds),
--       13 closed retention ms (the session hash's TTL after a close; the grace TTL when absent)
-- Fields (broker/redis/layouts.py): reads session owner, epoch, committed_step_id, reset_pending, trainer,
--       result_window;
--       writes session committed_step_id, context_length, reset_pending (reset), drops first_version
--       (reset: the next committed step starts a new trajectory, docs/async_rl.md); drops the log
--       and its result blobs (reset; a close expires them with the log, prelude.lua log_blobs);
--       adds a reply entry (kind, job_id, committed, result '') unless job_id is '' (an idle close)
-- A reset that control.lua never enqueued (reset_pending 0: a forged or replayed entry) is refused
-- like a fenced job: applied, it would move committed to -1 while next_step_id stays put. A retry
-- of a call that went through (the entry is no longer in the inbox) changes nothing.
-- Returns {'applied', committed} | {'fenced', owner, epoch} | {'unrequested', committed}
local session_key = KEYS[1]
local log_key = KEYS[2]
local inbox_key = KEYS[3]
local reply_key = KEYS[4]
local pool_key = KEYS[5]
local sessions_key = KEYS[6]
local owned_key = KEYS[7]
local trainer_open_key = KEYS[8]
local worker_id = ARGV[1]
local job_epoch = ARGV[2]
local entry_id = ARGV[3]
local job_id = ARGV[4]
local kind = ARGV[5]
local grace_ttl_ms = ARGV[6]
local reply_ttl_ms = ARGV[7]
local inbox_group = ARGV[8]
local session_id = ARGV[9]
local stream_bytes = ARGV[10]
local large_bytes = ARGV[11]
local large_ttl_ms = ARGV[12]
local closed_retention_ms = ARGV[13]
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'reset_pending', 'trainer',
  'result_window')
if s[1] and fenced(s[1], s[2], worker_id, job_epoch) then
  return {'fenced', s[1], s[2]}
end
local committed = tonumber(s[3] or '-1')
local window = tonumber(s[6] or '1')
if #redis.call('XRANGE', inbox_key, entry_id, entry_id) == 0 then
  -- The entry is gone: this is the retry of a call that went through (its reply was lost).
  -- Applying again would count the reset or the close twice.
  return {'applied', committed}
end
if s[1] and kind == 'reset' and s[4] == '0' then
  return {'unrequested', committed}
end
if s[1] then
  if kind == 'reset' then
    for _, blob in ipairs(log_blobs(log_key, committed, window)) do
      hand_over_or(blob, delete_key)
    end
    redis.call('DEL', log_key)
    committed = -1
    local pending = tonumber(s[4] or '1') - 1
    if pending < 0 then pending = 0 end
    redis.call('HSET', session_key, 'committed_step_id', -1, 'context_length', 0, 'reset_pending', pending)
    redis.call('HDEL', session_key, 'first_version')
  else
    -- Only while the worker is in the pool: a draining or not-ready worker left it, and ZINCRBY
    -- would add it back at -1, the least-loaded place of all.
    if redis.call('ZSCORE', pool_key, worker_id) then
      redis.call('ZINCRBY', pool_key, -1, worker_id)
    end
    if tonumber(redis.call('HGET', owned_key, worker_id) or '0') > 0 then  -- never below 0, never revived
      redis.call('HINCRBY', owned_key, worker_id, -1)
    end
    -- A session created before trainers were counted has no trainer: nothing to count down.
    if s[5] and trainer_open_key and redis.call('HINCRBY', trainer_open_key, s[5], -1) <= 0 then
      redis.call('HDEL', trainer_open_key, s[5])  -- never below 0, and no field left per trainer gone
    end
    redis.call('HDEL', sessions_key, session_id)
    redis.call('PEXPIRE', session_key, closed_retention_ms or grace_ttl_ms)
    for _, blob in ipairs(log_blobs(log_key, committed, window)) do
      hand_over_or(blob, function(key) redis.call('PEXPIRE', key, grace_ttl_ms) end)
    end
    redis.call('PEXPIRE', log_key, grace_ttl_ms)
  end
end
redis.call('XACK', inbox_key, inbox_group, entry_id)
redis.call('XDEL', inbox_key, entry_id)
if job_id ~= '' then  -- an idle close (close_idle.lua) asks no reply
  add_reply(reply_key, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms, kind, job_id, committed, '')
end
return {'applied', committed}
