-- Refresh a worker's liveness: the heartbeat score, its description and the description's expiry.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 workers zset, 2 worker hash
-- ARGV: 1 worker id, 2 worker hash ttl ms, 3.. field/value pairs
-- Fields: writes the worker hash's heartbeat_ms and the given fields
-- Returns {now, still_registered (1|0)}
local now = now_ms()
local known = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not known then
  return {now, 0}
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], 'heartbeat_ms', now, unpack(ARGV, 3))
else
  redis.call('HSET', KEYS[2], 'heartbeat_ms', now)
end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {now, 1}
