-- Refresh a worker's liveness: the heartbeat score, its description and the description's expiry.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 workers zset, 2 worker hash, 3 pressure hash
-- ARGV: 1 worker id, 2 worker hash ttl ms, 3 engine pressure (0..1, placement's load signal),
--       4.. field/value pairs
-- Fields: writes the worker hash's heartbeat_ms and the given fields, and the worker's pressure
-- Returns {now, still_registered (1|0)}
local now = now_ms()
local known = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not known then
  return {now, 0}
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
if #ARGV > 3 then
  redis.call('HSET', KEYS[2], 'heartbeat_ms', now, unpack(ARGV, 4))
else
  redis.call('HSET', KEYS[2], 'heartbeat_ms', now)
end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {now, 1}
