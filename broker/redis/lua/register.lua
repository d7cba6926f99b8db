-- Register a worker (a new incarnation) and join the placement pools it serves.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 workers zset, 2 capacity hash, 3 worker hash, 4 inbox, 5 pool index set, 6 owned hash,
--       7.. pool zsets
-- ARGV: 1 worker id, 2 capacity, 3 worker hash ttl ms, 4 inbox group, then one cap per pool KEY in
--       order ('' none: only the worker's capacity bounds that pool), then field/value pairs
-- Fields: writes the worker hash anew: registered_ms, heartbeat_ms and the given fields; the
--       capacity hash's worker@pool fields (the per-model split); owned 0 (a new incarnation)
-- Returns now (ms, Redis clock)
local now = now_ms()
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[6], ARGV[1], 0)
local pools = #KEYS - 6
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'registered_ms', now, 'heartbeat_ms', now, unpack(ARGV, 5 + pools))
redis.call('PEXPIRE', KEYS[3], ARGV[3])
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[4], ARGV[4], '0', 'MKSTREAM')
for i = 7, #KEYS do
  redis.call('ZADD', KEYS[i], 'NX', 0, ARGV[1])
  redis.call('SADD', KEYS[5], KEYS[i])
  local split = ARGV[i - 2]
  if split ~= '' then
    redis.call('HSET', KEYS[2], ARGV[1] .. '@' .. KEYS[i], split)
  else
    redis.call('HDEL', KEYS[2], ARGV[1] .. '@' .. KEYS[i])
  end
end
return now
