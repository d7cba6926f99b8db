-- Mark a session no live worker could take (failover found none with free capacity), so a trainer
-- waiting on its step learns capacity_exhausted (broker/client/waiting.py) instead of waiting out
-- its timeout. failover.lua drops the mark when the session moves.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 session hash
-- ARGV: 1 the owner being failed over (or draining)
-- Fields (broker/redis/layouts.py SessionHash): reads owner; writes unplaced_ms
-- Returns 1 when marked, 0 when the session is gone or has another owner by now
local session_key = KEYS[1]
local failing_owner = ARGV[1]
local owner = redis.call('HGET', session_key, 'owner')
if owner ~= failing_owner then
  return 0
end
redis.call('HSET', session_key, 'unplaced_ms', now_ms())
return 1
