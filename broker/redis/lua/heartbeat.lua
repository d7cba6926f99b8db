-- A worker's full heartbeat: its liveness by the Redis clock, what changed in its description, the
-- description's expiry, and what the worker needs to pace itself (workers/heartbeat.py). Between
-- full heartbeats a worker keeps its lease with one `ZADD workers XX CH` of its own estimate of the
-- Redis clock, taken from the `now` this returns.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 workers zset, 2 worker hash, 3 pressure hash, 4 owned hash
-- ARGV: 1 worker id, 2 worker hash ttl ms, 3 engine pressure (0..1, placement's load signal; '' leaves
--       it as it is), 4.. field/value pairs (the ones that changed since the last heartbeat)
-- Fields: writes the worker hash's heartbeat_ms with the given fields (only when fields are given),
--       and the worker's pressure
-- Returns {now, still_registered (1|0), workers registered, sessions the worker owns,
--       described (1: the worker hash was there, 0: it had expired: send every field again)}
local workers_key = KEYS[1]
local worker_key = KEYS[2]
local pressure_key = KEYS[3]
local owned_key = KEYS[4]
local worker_id = ARGV[1]
local worker_ttl_ms = ARGV[2]
local pressure = ARGV[3]
local first_field = 4
local now = now_ms()
-- XX: never adds a worker the reaper retired. 0 changed: not registered, or already at this score.
if redis.call('ZADD', workers_key, 'XX', 'CH', now, worker_id) == 0
    and not redis.call('ZSCORE', workers_key, worker_id) then
  return {now, 0, 0, 0, 0}
end
if pressure ~= '' then
  redis.call('HSET', pressure_key, worker_id, pressure)
end
local described = redis.call('PEXPIRE', worker_key, worker_ttl_ms)
if #ARGV >= first_field then
  redis.call('HSET', worker_key, 'heartbeat_ms', now, unpack(ARGV, first_field))
  if described == 0 then
    redis.call('PEXPIRE', worker_key, worker_ttl_ms)
  end
end
local owned = tonumber(redis.call('HGET', owned_key, worker_id) or '0') or 0
return {now, 1, redis.call('ZCARD', workers_key), owned, described}
