-- A trainer acknowledges a result it has stored: remember (session, step) as handled by the group,
-- acknowledge and delete the entry. Returns 1 the first time the group handles that step, 0 for
-- a duplicate delivery (a re-published or re-claimed result).
-- KEYS: 1 results stream, 2 handled hash of the group
-- ARGV: 1 group, 2 entry id, 3 handled field "session_id:step_id" (layouts.handled_field), 4 handled ttl ms
-- Returns 1 | 0
local first = redis.call('HSETNX', KEYS[2], ARGV[3], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return first
