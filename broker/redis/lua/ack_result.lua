-- A trainer acknowledges a result it has stored: remember (session, step) as handled by the group,
-- acknowledge and delete the entry. Returns 1 the first time the group handles that step, 0 for
-- a duplicate delivery (a re-published or re-claimed result).
-- KEYS: 1 results stream, 2 handled hash of the group
-- ARGV: 1 group, 2 entry id, 3 handled field "session_id:step_id" (layouts.handled_field), 4 handled ttl ms
-- Returns 1 | 0
local results_key = KEYS[1]
local handled_key = KEYS[2]
local group = ARGV[1]
local entry_id = ARGV[2]
local handled_field = ARGV[3]
local handled_ttl_ms = ARGV[4]
local first = redis.call('HSETNX', handled_key, handled_field, 1)
redis.call('PEXPIRE', handled_key, handled_ttl_ms)
redis.call('XACK', results_key, group, entry_id)
redis.call('XDEL', results_key, entry_id)
return first
