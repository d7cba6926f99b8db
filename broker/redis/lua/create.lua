-- Create a session on the least loaded live worker serving (mode, model) with free capacity.
-- Load score: the worker's session share (owned over all its pools / its capacity) plus the engine
-- pressure its heartbeat published (0..1); the lowest wins, the pool's order breaks ties. One pass
-- over the pool: O(pool size).
-- Uses: prelude.lua (now_ms, share_with_room, step_text)
-- The trainer's cap (KEYS[9] field trainer, else field '*'; none: no cap) is checked first: a
-- trainer with as many open sessions as its cap (KEYS[10]) is refused before placement.
-- Admission (docs/async_rl.md): with ARGV 11 set, the session is a new trajectory of a producer
-- bounded AReaL-style: at most (version + max_offpolicyness + 1) x batch_size admitted for the
-- model under the producer's name, version being the highest announced for the model; over it,
-- admission_closed and nothing changes. The count moves in the same script as the create.
-- KEYS: 1 workers zset, 2 capacity hash, 3 pool zset (mode, model), 4 session hash, 5 sessions hash
--       (session id -> owner), 6 owned hash (worker -> sessions), 7 pressure hash (worker -> 0..1),
--       8 announced hash (model -> version), 9 trainer caps hash, 10 trainer open hash (trainer ->
--       open sessions), 11 admission hash (model -> admitted; with ARGV 11 only)
-- ARGV: 1 session_id, 2 mode, 3 model, 4 lease_ms, 5 retention, 6 result_window, 7 idle timeout ms,
--       8 max_staleness ('' = none), 9 priority ('interactive'|'bulk'), 10 trainer,
--       11 admission batch_size ('' = no admission), 12 admission max_offpolicyness,
--       13 admission name (for the message)
-- Fields (broker/redis/layouts.py SessionHash): writes the whole session hash: mode, model, owner,
--       epoch, committed_step_id, next_step_id, context_length, closed, gen, reset_pending,
--       retention, result_window, idle_timeout_ms, idle_closed, cancels, forked_from, created_ms,
--       updated_ms, priority, trainer, max_staleness (only when set); reads announced <model>; reads
--       and moves admission <model>
-- Returns {'created', owner} | {'error', code, message}
local now = now_ms()
local lease = tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {'error', 'invalid_request', 'session ' .. ARGV[1] .. ' already exists'}
end
local trainer = ARGV[10]
local cap = redis.call('HGET', KEYS[9], trainer) or redis.call('HGET', KEYS[9], '*')
local open = tonumber(redis.call('HGET', KEYS[10], trainer) or '0') or 0
if cap and open >= (tonumber(cap) or 0) then
  return {'error', 'trainer_cap_reached', 'trainer ' .. trainer .. ' has ' .. open .. ' open sessions in this cell, '
          .. 'its cap is ' .. cap .. ': close one first, or ask the operator for a higher cap'}
end
local members = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
local chosen, best = nil, nil
for i = 1, #members, 2 do
  local wid = members[i]
  local hb = redis.call('ZSCORE', KEYS[1], wid)
  if hb and now - tonumber(hb) <= lease then
    local share = share_with_room(KEYS[2], KEYS[6], KEYS[3], wid, members[i + 1])
    if share then
      local score = share + (tonumber(redis.call('HGET', KEYS[7], wid) or '0') or 0)
      if not best or score < best then
        chosen, best = wid, score
      end
    end
  end
end
if #members == 0 then
  return {'error', 'invalid_request',
          'unknown model or mode: no worker serves model ' .. ARGV[3] .. ' in mode ' .. ARGV[2]}
end
if not chosen then
  return {'error', 'capacity_exhausted',
          'no live worker with free capacity serves model ' .. ARGV[3] .. ' in mode ' .. ARGV[2]}
end
if ARGV[11] and ARGV[11] ~= '' then
  local version = tonumber(redis.call('HGET', KEYS[8], ARGV[3]) or '0') or 0
  local count = tonumber(redis.call('HGET', KEYS[11], ARGV[3]) or '0') or 0
  local bound = (version + tonumber(ARGV[12]) + 1) * tonumber(ARGV[11])
  if count >= bound then
    return {'error', 'admission_closed', 'admission ' .. ARGV[13] .. ' of model ' .. ARGV[3] .. ' is closed: '
      .. step_text(count) .. ' trajectories admitted, the bound at policy version ' .. step_text(version)
      .. ' is (version + ' .. ARGV[12] .. ' + 1) x ' .. ARGV[11] .. ' = ' .. step_text(bound)
      .. '; it opens when a later version is announced'}
  end
  redis.call('HINCRBY', KEYS[11], ARGV[3], 1)
end
redis.call('ZINCRBY', KEYS[3], 1, chosen)
redis.call('HINCRBY', KEYS[6], chosen, 1)
redis.call('HINCRBY', KEYS[10], trainer, 1)
redis.call('HSET', KEYS[4],
  'mode', ARGV[2], 'model', ARGV[3], 'owner', chosen, 'epoch', 1,
  'committed_step_id', -1, 'next_step_id', 0, 'context_length', 0, 'closed', 0,
  'gen', 0, 'reset_pending', 0, 'retention', ARGV[5], 'result_window', ARGV[6],
  'idle_timeout_ms', ARGV[7] or 0, 'idle_closed', 0, 'cancels', 0, 'forked_from', '',
  'created_ms', now, 'updated_ms', now, 'priority', ARGV[9], 'trainer', trainer)
if ARGV[8] and ARGV[8] ~= '' then
  redis.call('HSET', KEYS[4], 'max_staleness', ARGV[8])
end
redis.call('HSET', KEYS[5], ARGV[1], chosen)
return {'created', chosen}
