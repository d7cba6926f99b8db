-- Refresh a worker's liveness: the heartbeat score, its description and the description's expiry.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 workers zset, 2 worker hash, 3 pressure hash
-- ARGV: 1 worker id, 2 worker hash ttl ms, 3 engine pressure (0..1, placement's load signal),
--       4.. field/value pairs
-- Fields: writes the worker hash's heartbeat_ms and the given fields, and the worker's pressure
-- Returns {now, still_registered (1|0)}
local workers_key = KEYS[1]
local worker_key = KEYS[2]
local pressure_key = KEYS[3]
local worker_id = ARGV[1]
local worker_ttl_ms = ARGV[2]
local pressure = ARGV[3]
local first_field = 4
local now = now_ms()
local known = redis.call('ZSCORE', workers_key, worker_id)
if not known then
  return {now, 0}
end
redis.call('ZADD', workers_key, now, worker_id)
redis.call('HSET', pressure_key, worker_id, pressure)
if #ARGV >= first_field then
  redis.call('HSET', worker_key, 'heartbeat_ms', now, unpack(ARGV, first_field))
else
  redis.call('HSET', worker_key, 'heartbeat_ms', now)
end
redis.call('PEXPIRE', worker_key, worker_ttl_ms)
return {now, 1}
