-- Stop taking new sessions (drain, shutdown): leave every placement pool.
-- KEYS: 1 worker hash, 2.. pool zsets
-- ARGV: 1 worker id, 2 state
-- Fields: writes the worker hash's state (if the hash still exists)
-- Returns 1
for i = 2, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'state', ARGV[2])
end
return 1
