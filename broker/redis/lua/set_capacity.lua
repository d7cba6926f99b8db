-- Set a registered worker's capacity; 0 keeps it out of placement and failover (its engine is not
-- ready) while its pool entries, their loads and its sessions stay as they are.
-- KEYS: 1 capacity hash, 2 worker hash
-- ARGV: 1 worker id, 2 capacity, 3.. field/value pairs for the worker hash (why: engine_ready, ...)
-- Fields: writes the given fields of the worker hash with the capacity, so the two never disagree
-- Returns 1 when set, 0 when the worker is not registered (retired: a capacity would outlive it)
local capacity_key = KEYS[1]
local worker_key = KEYS[2]
local worker_id = ARGV[1]
local capacity = ARGV[2]
local first_field = 3
if redis.call('EXISTS', worker_key) == 0 then
  return 0
end
redis.call('HSET', capacity_key, worker_id, capacity)
if #ARGV >= first_field then
  redis.call('HSET', worker_key, unpack(ARGV, first_field))
end
return 1
