-- Move one session from its old owner to a new one: lease epoch + 1, and the session's queued and
-- unacknowledged jobs move with it, in order, re-stamped with the new epoch. After this the old
-- owner can neither commit (fenced) nor receive the session's jobs.
-- reason 'expired': only if the old owner's heartbeat is older than the lease.
-- reason 'handover': the old owner itself hands the session over (drain), no lease wait.
-- reason 'rebalance': the old owner moves a session to a less loaded worker (workers/rebalance.py);
-- checked like a handover.
-- Uses: prelude.lua (now_ms, share_with_room)
-- KEYS: 1 workers zset, 2 capacity hash, 3 pool zset (mode, model), 4 session hash, 5 old inbox,
--       6 new inbox, 7 sessions hash, 8 owned hash
-- ARGV: 1 old worker id, 2 new worker id, 3 lease ms, 4 session_id, 5 reason, 6 inbox group
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch; writes session owner,
--       epoch, updated_ms, drops unplaced_ms; moves inbox entries whole (matched by session_id,
--       epoch re-stamped); moves one session of the owned hash from the old owner to the new
-- Returns {'moved', new_epoch, jobs_moved} | {'skip', owner} | {'gone'} | {'alive'}
--       | {'retry', why}
local s = redis.call('HMGET', KEYS[4], 'owner', 'epoch')
if not s[1] then
  return {'gone'}
end
if s[1] ~= ARGV[1] then
  return {'skip', s[1]}
end
local now = now_ms()
local lease = tonumber(ARGV[3])
if ARGV[5] == 'expired' then
  local hb = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if hb and now - tonumber(hb) <= lease then
    return {'alive'}
  end
end
local nhb = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not nhb or now - tonumber(nhb) > lease then
  return {'retry', 'new owner ' .. ARGV[2] .. ' is not live'}
end
local load = redis.call('ZSCORE', KEYS[3], ARGV[2])
if not load or not share_with_room(KEYS[2], KEYS[8], KEYS[3], ARGV[2], load) then
  return {'retry', 'new owner ' .. ARGV[2] .. ' has no free capacity for this model'}
end
local epoch = tonumber(s[2]) + 1
local moved = 0
local entries = redis.call('XRANGE', KEYS[5], '-', '+')
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  local mine = false
  for i = 1, #fields, 2 do
    if fields[i] == 'session_id' and fields[i + 1] == ARGV[4] then
      mine = true
    end
  end
  if mine then
    for i = 1, #fields, 2 do
      if fields[i] == 'epoch' then
        fields[i + 1] = epoch
      end
    end
    redis.call('XADD', KEYS[6], '*', unpack(fields))
    redis.call('XACK', KEYS[5], ARGV[6], id)
    redis.call('XDEL', KEYS[5], id)
    moved = moved + 1
  end
end
redis.call('HSET', KEYS[4], 'owner', ARGV[2], 'epoch', epoch, 'updated_ms', now)
redis.call('HDEL', KEYS[4], 'unplaced_ms')
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  redis.call('ZINCRBY', KEYS[3], -1, ARGV[1])
end
redis.call('ZINCRBY', KEYS[3], 1, ARGV[2])
if tonumber(redis.call('HGET', KEYS[8], ARGV[1]) or '0') > 0 then  -- a retired owner's count is gone
  redis.call('HINCRBY', KEYS[8], ARGV[1], -1)
end
redis.call('HINCRBY', KEYS[8], ARGV[2], 1)
redis.call('HSET', KEYS[7], ARGV[4], ARGV[2])
return {'moved', epoch, moved}
