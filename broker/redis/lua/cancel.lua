-- Cancel a session's steps that have not committed: the queued ones and the one running. The
-- session's cancel count goes up, so commit.lua refuses every step enqueued before (each is
-- answered `cancelled` by the owner); next_step_id goes back to committed + 1 (0 when a reset is
-- queued: steps after a reset start at 0), so the trainer goes on from the committed step. A step
-- that committed before this call stays committed. A `cancel` entry tells the owner at once (its
-- reader acts on it before the queued steps: workers/fork_cancel.py). gen + 1: a late fallback of a
-- cancelled step (report.lua) must not move next_step_id under the steps sent after the cancel.
-- Uses: prelude.lua (now_ms, session_refusal)
-- KEYS: 1 session hash, 2 inbox of the believed owner
-- ARGV: 1 believed owner, 2 session_id
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch, committed_step_id,
--       next_step_id, context_length, closed, gen, reset_pending, cancels, mode, model; writes
--       session cancels, gen, next_step_id, updated_ms; adds an inbox entry (the fields of
--       enqueue.lua's, kind 'cancel', step_id -1, job_id and reply_to '', payload '')
-- Returns {'cancelled', committed, next_step_id before, next_step_id after}
--       | {'error', code, message, committed, context_length} | {'moved', owner}
local session_key = KEYS[1]
local inbox_key = KEYS[2]
local believed_owner = ARGV[1]
local session_id = ARGV[2]
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'next_step_id', 'context_length',
  'closed', 'gen', 'reset_pending', 'cancels', 'mode', 'model')
local committed = tonumber(s[3])
local refusal = session_refusal(s[1], s[6], committed, s[5], believed_owner, session_id)
if refusal then
  return refusal
end
local nxt = committed + 1
if s[8] ~= '0' then
  nxt = 0
end
local cancels = tonumber(s[9] or '0') + 1
local gen = tonumber(s[7]) + 1
local now = now_ms()
redis.call('HSET', session_key, 'cancels', cancels, 'gen', gen, 'next_step_id', nxt, 'updated_ms', now)
redis.call('XADD', inbox_key, '*',
  'kind', 'cancel', 'job_id', '', 'session_id', session_id, 'step_id', -1, 'contextual', '1',
  'epoch', s[2], 'gen', gen, 'mode', s[10], 'model', s[11], 'reply_to', '',
  'enqueued_ms', now, 'attempt', 0, 'cancels', cancels, 'payload', '')
return {'cancelled', committed, tonumber(s[4]), nxt}
