-- Move one session from its old owner to a new one: lease epoch + 1, and the session's queued and
-- unacknowledged jobs move with it, in order, re-stamped with the new epoch. After this the old
-- owner can neither commit (fenced) nor receive the session's jobs.
-- reason 'expired': only if the old owner's heartbeat is older than the lease.
-- reason 'handover': the old owner itself hands the session over (drain), no lease wait.
-- reason 'rebalance': the old owner moves a session to a less loaded worker (workers/rebalance.py);
-- checked like a handover.
-- Uses: prelude.lua (now_ms, share_with_room, unpacked_entry, reads_packed)
-- KEYS: 1 workers zset, 2 capacity hash, 3 pool zset (mode, model), 4 session hash, 5 old inbox,
--       6 new inbox, 7 sessions hash, 8 owned hash, 9 new owner's worker hash
-- ARGV: 1 old worker id, 2 new worker id, 3 lease ms, 4 session_id, 5 reason, 6 inbox group
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch; writes session owner,
--       epoch, updated_ms, drops unplaced_ms; moves inbox entries whole (matched by session_id,
--       epoch re-stamped; a packed entry unpacked for a new owner whose worker hash does not say it
--       reads one, broker/redis/inbox.py); moves one session of the owned hash from the old owner
--       to the new
-- Returns {'moved', new_epoch, jobs_moved} | {'skip', owner} | {'gone'} | {'alive'}
--       | {'retry', why}
local workers_key = KEYS[1]
local capacity_key = KEYS[2]
local pool_key = KEYS[3]
local session_key = KEYS[4]
local old_inbox_key = KEYS[5]
local new_inbox_key = KEYS[6]
local sessions_key = KEYS[7]
local owned_key = KEYS[8]
local new_worker_key = KEYS[9]
local old_owner = ARGV[1]
local new_owner = ARGV[2]
local lease = tonumber(ARGV[3])
local session_id = ARGV[4]
local reason = ARGV[5]
local inbox_group = ARGV[6]
local s = redis.call('HMGET', session_key, 'owner', 'epoch')
if not s[1] then
  return {'gone'}
end
if s[1] ~= old_owner then
  return {'skip', s[1]}
end
local now = now_ms()
if reason == 'expired' then
  local hb = redis.call('ZSCORE', workers_key, old_owner)
  if hb and now - tonumber(hb) <= lease then
    return {'alive'}
  end
end
local nhb = redis.call('ZSCORE', workers_key, new_owner)
if not nhb or now - tonumber(nhb) > lease then
  return {'retry', 'new owner ' .. new_owner .. ' is not live'}
end
local load = redis.call('ZSCORE', pool_key, new_owner)
if not load or not share_with_room(capacity_key, owned_key, pool_key, new_owner, load) then
  return {'retry', 'new owner ' .. new_owner .. ' has no free capacity for this model'}
end
local epoch = tonumber(s[2]) + 1
local moved = 0
local new_reads_packed = reads_packed(new_worker_key)
local entries = redis.call('XRANGE', old_inbox_key, '-', '+')
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  local mine = false
  for i = 1, #fields, 2 do
    if fields[i] == 'session_id' and fields[i + 1] == session_id then
      mine = true
    end
  end
  if mine then
    for i = 1, #fields, 2 do
      if fields[i] == 'epoch' then
        fields[i + 1] = epoch
      end
    end
    if not new_reads_packed then
      fields = unpacked_entry(fields)
    end
    redis.call('XADD', new_inbox_key, '*', unpack(fields))
    redis.call('XACK', old_inbox_key, inbox_group, id)
    redis.call('XDEL', old_inbox_key, id)
    moved = moved + 1
  end
end
redis.call('HSET', session_key, 'owner', new_owner, 'epoch', epoch, 'updated_ms', now)
redis.call('HDEL', session_key, 'unplaced_ms')
if redis.call('ZSCORE', pool_key, old_owner) then
  redis.call('ZINCRBY', pool_key, -1, old_owner)
end
redis.call('ZINCRBY', pool_key, 1, new_owner)
if tonumber(redis.call('HGET', owned_key, old_owner) or '0') > 0 then  -- a retired owner's count is gone
  redis.call('HINCRBY', owned_key, old_owner, -1)
end
redis.call('HINCRBY', owned_key, new_owner, 1)
redis.call('HSET', sessions_key, session_id, new_owner)
return {'moved', epoch, moved}
