-- Create a session on the least loaded live worker serving (mode, model) with free capacity.
-- Load score: the worker's session share (owned over all its pools / its capacity) plus the engine
-- pressure its heartbeat published (0..1); the lowest wins, the pool's order breaks ties. One pass
-- over the pool: O(pool size) in Redis's own lookups, but a fixed number of commands (the pool, then
-- every member's heartbeat, capacity, pool cap, owned count and pressure, each in one ZMSCORE or
-- HMGET): a command per member and lookup cost a master ~3.7 ms per create at 333 workers.
-- Uses: prelude.lua (now_ms, share_if_room, hmget_many, zmscore_many, step_text, keep_hashtable)
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
--       updated_ms, priority, trainer, max_staleness (only when set), and the encoding field
--       (prelude.lua keep_hashtable); reads announced <model>; reads
--       and moves admission <model>
-- Returns {'created', owner} | {'error', code, message}
local workers_key = KEYS[1]
local capacity_key = KEYS[2]
local pool_key = KEYS[3]
local session_key = KEYS[4]
local sessions_key = KEYS[5]
local owned_key = KEYS[6]
local pressure_key = KEYS[7]
local announced_key = KEYS[8]
local trainer_caps_key = KEYS[9]
local trainer_open_key = KEYS[10]
local admission_key = KEYS[11]
local session_id = ARGV[1]
local mode = ARGV[2]
local model = ARGV[3]
local lease = tonumber(ARGV[4])
local retention = ARGV[5]
local result_window = ARGV[6]
local idle_timeout_ms = ARGV[7]
local max_staleness = ARGV[8]
local priority = ARGV[9]
local trainer = ARGV[10]
local admission_batch = ARGV[11]
local admission_offpolicyness = ARGV[12]
local admission_name = ARGV[13]
local now = now_ms()
if redis.call('EXISTS', session_key) == 1 then
  return {'error', 'invalid_request', 'session ' .. session_id .. ' already exists'}
end
local cap = redis.call('HGET', trainer_caps_key, trainer) or redis.call('HGET', trainer_caps_key, '*')
local open = tonumber(redis.call('HGET', trainer_open_key, trainer) or '0') or 0
if cap and open >= (tonumber(cap) or 0) then
  return {'error', 'trainer_cap_reached', 'trainer ' .. trainer .. ' has ' .. open .. ' open sessions in this cell, '
          .. 'its cap is ' .. cap .. ': close one first, or ask the operator for a higher cap'}
end
local members = redis.call('ZRANGE', pool_key, 0, -1, 'WITHSCORES')
local ids, loads, splits = {}, {}, {}
for i = 1, #members, 2 do
  ids[#ids + 1], loads[#loads + 1] = members[i], members[i + 1]
  splits[#splits + 1] = members[i] .. '@' .. pool_key
end
local chosen, best = nil, nil
if #ids > 0 then
  local hbs = zmscore_many(workers_key, ids)
  local caps = hmget_many(capacity_key, ids)
  local split_caps = hmget_many(capacity_key, splits)
  local owned = hmget_many(owned_key, ids)
  local pressures = hmget_many(pressure_key, ids)
  for j, wid in ipairs(ids) do
    local hb = hbs[j]
    if hb and now - tonumber(hb) <= lease then
      local share = share_if_room(caps[j], owned[j], split_caps[j], loads[j])
      if share then
        local score = share + (tonumber(pressures[j] or '0') or 0)
        if not best or score < best then
          chosen, best = wid, score
        end
      end
    end
  end
end
if #members == 0 then
  return {'error', 'invalid_request',
          'unknown model or mode: no worker serves model ' .. model .. ' in mode ' .. mode}
end
if not chosen then
  return {'error', 'capacity_exhausted',
          'no live worker with free capacity serves model ' .. model .. ' in mode ' .. mode}
end
if admission_batch and admission_batch ~= '' then
  local version = tonumber(redis.call('HGET', announced_key, model) or '0') or 0
  local count = tonumber(redis.call('HGET', admission_key, model) or '0') or 0
  local bound = (version + tonumber(admission_offpolicyness) + 1) * tonumber(admission_batch)
  if count >= bound then
    return {'error', 'admission_closed', 'admission ' .. admission_name .. ' of model ' .. model .. ' is closed: '
      .. step_text(count) .. ' trajectories admitted, the bound at policy version ' .. step_text(version)
      .. ' is (version + ' .. admission_offpolicyness .. ' + 1) x ' .. admission_batch .. ' = ' .. step_text(bound)
      .. '; it opens when a later version is announced'}
  end
  redis.call('HINCRBY', admission_key, model, 1)
end
redis.call('ZINCRBY', pool_key, 1, chosen)
redis.call('HINCRBY', owned_key, chosen, 1)
redis.call('HINCRBY', trainer_open_key, trainer, 1)
keep_hashtable(session_key)  -- first, so the fields below go straight into the hashtable
redis.call('HSET', session_key,
  'mode', mode, 'model', model, 'owner', chosen, 'epoch', 1,
  'committed_step_id', -1, 'next_step_id', 0, 'context_length', 0, 'closed', 0,
  'gen', 0, 'reset_pending', 0, 'retention', retention, 'result_window', result_window,
  'idle_timeout_ms', idle_timeout_ms or 0, 'idle_closed', 0, 'cancels', 0, 'forked_from', '',
  'created_ms', now, 'updated_ms', now, 'priority', priority, 'trainer', trainer, 'last_blob_step', -1)
if max_staleness and max_staleness ~= '' then
  redis.call('HSET', session_key, 'max_staleness', max_staleness)
end
redis.call('HSET', sessions_key, session_id, chosen)
return {'created', chosen}
