-- Stop taking new sessions (drain, shutdown): leave every placement pool.
-- KEYS: 1 worker hash, 2.. pool zsets
-- ARGV: 1 worker id, 2 state
-- Fields: writes the worker hash's state (if the hash still exists)
-- Returns 1
local worker_key = KEYS[1]
local first_pool = 2
local worker_id = ARGV[1]
local state = ARGV[2]
for i = first_pool, #KEYS do
  redis.call('ZREM', KEYS[i], worker_id)
end
if redis.call('EXISTS', worker_key) == 1 then
  redis.call('HSET', worker_key, 'state', state)
end
return 1
