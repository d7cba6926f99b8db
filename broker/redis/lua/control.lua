-- Enqueue a reset or close control job: it keeps its order with the steps queued before it.
-- reset: steps after it start again at step 0 (a new generation); committed moves to -1 when the
--        owner applies it. close: marks the session closed at once (later steps get
--        session_closed); the owner drops the engine state after the queued steps. Closing twice
--        is fine.
-- Uses: prelude.lua (now_ms, session_refusal)
-- KEYS: 1 session hash, 2 inbox of the believed owner
-- ARGV: 1 believed owner, 2 kind ('reset'|'close'), 3 job_id, 4 reply_to, 5 session_id
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch, committed_step_id,
--       context_length, closed, gen, mode, model; writes session next_step_id, gen,
--       reset_pending (reset) or closed (close), updated_ms; adds an inbox entry (the fields of
--       enqueue.lua's, step_id -1, payload '')
-- Returns {'queued', entry_id, committed} | {'already_closed', committed}
--       | {'error', code, message, committed, context_length} | {'moved', owner}
local session_key = KEYS[1]
local inbox_key = KEYS[2]
local believed_owner = ARGV[1]
local kind = ARGV[2]
local job_id = ARGV[3]
local reply_to = ARGV[4]
local session_id = ARGV[5]
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'context_length',
  'closed', 'gen', 'mode', 'model')
local owner, committed = s[1], tonumber(s[3])
if owner and s[5] == '1' and kind == 'close' then
  return {'already_closed', committed}
end
local refusal = session_refusal(owner, s[5], committed, s[4], believed_owner, session_id)
if refusal then
  return refusal
end
local now = now_ms()
if kind == 'reset' then
  redis.call('HSET', session_key, 'next_step_id', 0, 'gen', tonumber(s[6]) + 1, 'updated_ms', now)
  redis.call('HINCRBY', session_key, 'reset_pending', 1)
else
  redis.call('HSET', session_key, 'closed', 1, 'updated_ms', now)
end
local id = redis.call('XADD', inbox_key, '*',
  'kind', kind, 'job_id', job_id, 'session_id', session_id, 'step_id', -1, 'contextual', '1',
  'epoch', s[2], 'gen', s[6], 'mode', s[7], 'model', s[8], 'reply_to', reply_to,
  'enqueued_ms', now, 'attempt', 0, 'payload', '')
return {'queued', id, committed}
