-- Close a session nobody used for longer than its idle timeout, through the ordinary close path:
-- the session is marked closed and the close job control.lua would enqueue goes to the owner's
-- inbox, where apply_control.lua frees its capacity. A session with steps queued or running, a
-- reset pending, activity within its timeout, or no timeout (0, sessions created before it) is
-- left alone. Called by the session's owner (workers/idle.py); its empty job_id asks no reply.
-- Uses: prelude.lua (now_ms)
-- KEYS: 1 session hash, 2 the owner's inbox
-- ARGV: 1 owner (the caller), 2 session_id
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch, committed_step_id,
--       next_step_id, closed, gen, mode, model, reset_pending, updated_ms, idle_timeout_ms; writes
--       closed, idle_closed, updated_ms; adds an inbox entry (control.lua's close entry, job_id '')
-- Returns {'closed', idle ms} | {'kept', ms until it could be idle (-1: it has no timeout)} while it is
--       the caller's and open | {'kept'} when it is not the caller's or closed already
local session_key = KEYS[1]
local inbox_key = KEYS[2]
local worker_id = ARGV[1]
local session_id = ARGV[2]
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'next_step_id', 'closed', 'gen',
  'mode', 'model', 'reset_pending', 'updated_ms', 'idle_timeout_ms')
local timeout = tonumber(s[11] or '0') or 0
if s[1] ~= worker_id or s[5] == '1' then
  return {'kept'}
end
if timeout <= 0 then
  return {'kept', -1}
end
local now = now_ms()
local idle = now - (tonumber(s[10] or '0') or 0)
local queued = tonumber(s[4]) ~= tonumber(s[3]) + 1 or (s[9] or '0') ~= '0'
if queued then  -- in use: its next step or reset moves updated_ms
  return {'kept', timeout}
end
if idle < timeout then
  return {'kept', timeout - idle}
end
redis.call('HSET', session_key, 'closed', 1, 'idle_closed', 1, 'updated_ms', now)
redis.call('XADD', inbox_key, '*',
  'kind', 'close', 'job_id', '', 'session_id', session_id, 'step_id', -1, 'contextual', '1',
  'epoch', s[2], 'gen', s[6], 'mode', s[7], 'model', s[8], 'reply_to', '',
  'enqueued_ms', now, 'attempt', 0, 'payload', '')
return {'closed', idle}
