-- Set a registered worker's capacity; 0 keeps it out of placement and failover (its engine is not
-- ready) while its pool entries, their loads and its sessions stay as they are.
-- KEYS: 1 capacity hash, 2 worker hash
-- ARGV: 1 worker id, 2 capacity, 3.. field/value pairs for the worker hash (why: engine_ready, ...)
-- Fields: writes the given fields of the worker hash with the capacity, so the two never disagree
-- Returns 1 when set, 0 when the worker is not registered (retired: a capacity would outlive it)
if redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
end
return 1
