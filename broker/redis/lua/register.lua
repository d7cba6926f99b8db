-- Register a worker (a new incarnation) and join the placement pools it serves.
-- Uses: prelude.lua (now_ms, keep_hashtable)
-- KEYS: 1 workers zset, 2 capacity hash, 3 worker hash, 4 inbox, 5 pool index set, 6 owned hash,
--       7 pressure hash, 8.. pool zsets
-- ARGV: 1 worker id, 2 capacity, 3 worker hash ttl ms, 4 inbox group, then one cap per pool KEY in
--       order ('' none: only the worker's capacity bounds that pool), then field/value pairs
-- Fields: writes the worker hash anew: registered_ms, heartbeat_ms and the given fields; the
--       capacity hash's worker@pool fields (the per-model split); owned 0 (a new incarnation); the
--       capacity, owned and pressure hashes' encoding field (prelude.lua keep_hashtable)
-- Returns now (ms, Redis clock)
local workers_key = KEYS[1]
local capacity_key = KEYS[2]
local worker_key = KEYS[3]
local inbox_key = KEYS[4]
local pool_index_key = KEYS[5]
local owned_key = KEYS[6]
local pressure_key = KEYS[7]
local first_pool = 8
local worker_id = ARGV[1]
local capacity = ARGV[2]
local worker_ttl_ms = ARGV[3]
local inbox_group = ARGV[4]
local first_cap = 5
local pools = #KEYS - first_pool + 1
local first_field = first_cap + pools
local now = now_ms()
keep_hashtable(capacity_key)
keep_hashtable(owned_key)
keep_hashtable(pressure_key)
redis.call('ZADD', workers_key, now, worker_id)
redis.call('HSET', capacity_key, worker_id, capacity)
redis.call('HSET', owned_key, worker_id, 0)
redis.call('DEL', worker_key)
redis.call('HSET', worker_key, 'registered_ms', now, 'heartbeat_ms', now, unpack(ARGV, first_field))
redis.call('PEXPIRE', worker_key, worker_ttl_ms)
pcall(redis.call, 'XGROUP', 'CREATE', inbox_key, inbox_group, '0', 'MKSTREAM')
for i = first_pool, #KEYS do
  local pool_key = KEYS[i]
  redis.call('ZADD', pool_key, 'NX', 0, worker_id)
  redis.call('SADD', pool_index_key, pool_key)
  local split = ARGV[first_cap + i - first_pool]
  if split ~= '' then
    redis.call('HSET', capacity_key, worker_id .. '@' .. pool_key, split)
  else
    redis.call('HDEL', capacity_key, worker_id .. '@' .. pool_key)
  end
end
return now
