-- Fork a session into n branches (GRPO-style groups): each branch is a new session that starts
-- from the parent's committed step, on the parent's worker (its engine shares the prefix). A
-- branch's first step is the parent's committed step + 1 (the numbering goes on); its committed
-- step, context length and step log (records and stored results) are the parent's, so a new
-- owner rebuilds it like any session. The branches count in the worker's capacity and in the
-- parent's trainer's open sessions like created sessions (and inherit its priority, trainer and
-- staleness bound, with the trajectory's first_version); no room for all n, or a trainer cap
-- they would pass, creates none. The parent must have no step queued or running (the
-- fork point is its committed step, here and on the worker): otherwise step_out_of_order. A `fork`
-- entry in the owner's inbox lets the worker copy the parent's engine state into the branches
-- (workers/fork_cancel.py); without it a branch rebuilds from its records on its first step.
-- Uses: prelude.lua (now_ms, session_refusal, result_blob, record_blob, slot_step, keep_hashtable)
-- KEYS: 1 parent session hash, 2 parent log hash, 3 sessions hash, 4 owned hash, 5 capacity hash,
--       6 pool zset (mode, model), 7 owner's inbox, 8 trainer caps hash, 9 trainer open hash, then
--       per branch: its session hash, its log hash
-- Derived keys (docs/architecture.md, "Keys in Lua scripts"): the result and record blobs of the
--       steps the parent's log holds (read here with HGETALL) and each branch's copies of them, built
--       from the parent's and the branch's log keys (prelude.lua result_blob, record_blob), in
--       their hash tag and slot.
-- ARGV: 1 believed owner, 2 parent session_id, 3.. branch session ids (n of them)
-- Fields (broker/redis/layouts.py SessionHash, inbox.py): reads the parent's owner, epoch,
--       committed_step_id, next_step_id, context_length, closed, gen, reset_pending, mode, model,
--       retention, result_window, idle_timeout_ms, priority, trainer, max_staleness, first_version;
--       writes each branch's whole session hash (as create.lua, plus forked_from, with its encoding
--       field) and log (a result
--       stored as a blob reference, and a record's input blob, get the branch's own copy: COPY,
--       never read); adds
--       an inbox entry (the fields of enqueue.lua's,
--       kind 'fork', step_id = the fork point, job_id and reply_to '', payload = the branch ids
--       separated by spaces)
-- Returns {'forked', committed} | {'error', code, message, committed, context_length} | {'moved', owner}
local session_key = KEYS[1]
local log_key = KEYS[2]
local sessions_key = KEYS[3]
local owned_key = KEYS[4]
local capacity_key = KEYS[5]
local pool_key = KEYS[6]
local inbox_key = KEYS[7]
local trainer_caps_key = KEYS[8]
local trainer_open_key = KEYS[9]
local believed_owner = ARGV[1]
local session_id = ARGV[2]
local first_branch_key = 10
local first_branch_id = 3
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'next_step_id', 'context_length',
  'closed', 'gen', 'reset_pending', 'mode', 'model', 'retention', 'result_window', 'idle_timeout_ms',
  'priority', 'trainer', 'max_staleness', 'first_version')
local owner, committed, ctx = s[1], tonumber(s[3]), s[5]
local refusal = session_refusal(owner, s[6], committed, ctx, believed_owner, session_id)
if refusal then
  return refusal
end
if s[8] ~= '0' or tonumber(s[4]) ~= committed + 1 then
  return {'error', 'step_out_of_order', 'session ' .. session_id .. ' has steps queued or a reset pending; '
    .. 'fork it once they are answered (or cancel them)', committed, ctx}
end
local n = #ARGV - first_branch_id + 1
if n < 1 then
  return {'error', 'invalid_request', 'fork needs at least one branch', committed, ctx}
end
for i = 1, n do
  if redis.call('EXISTS', KEYS[first_branch_key + 2 * (i - 1)]) == 1 then
    return {'error', 'invalid_request', 'session ' .. ARGV[first_branch_id + i - 1] .. ' already exists', committed,
      ctx}
  end
end
local cap = tonumber(redis.call('HGET', capacity_key, owner) or '0') or 0
local owned = tonumber(redis.call('HGET', owned_key, owner) or '0') or 0
local load = redis.call('ZSCORE', pool_key, owner)
local split = tonumber(redis.call('HGET', capacity_key, owner .. '@' .. pool_key) or '')
if not load or owned + n > cap or (split and tonumber(load) + n > split) then
  return {'error', 'capacity_exhausted', 'worker ' .. owner .. ' of session ' .. session_id .. ' has no room for '
    .. n .. ' more sessions', committed, ctx}
end
local trainer = s[15] or ''
local trainer_cap = redis.call('HGET', trainer_caps_key, trainer) or redis.call('HGET', trainer_caps_key, '*')
local trainer_open = tonumber(redis.call('HGET', trainer_open_key, trainer) or '0') or 0
if trainer ~= '' and trainer_cap and trainer_open + n > (tonumber(trainer_cap) or 0) then
  return {'error', 'trainer_cap_reached', 'trainer ' .. trainer .. ' has ' .. trainer_open .. ' open sessions in this '
    .. 'cell, its cap is ' .. trainer_cap .. ': no room for ' .. n .. ' branches', committed, ctx}
end
local now = now_ms()
local log = redis.call('HGETALL', log_key)
for i = 1, n do
  local child, child_log = KEYS[first_branch_key + 2 * (i - 1)], KEYS[first_branch_key + 2 * (i - 1) + 1]
  keep_hashtable(child)
  redis.call('HSET', child,
    'mode', s[9], 'model', s[10], 'owner', owner, 'epoch', 1,
    'committed_step_id', committed, 'next_step_id', committed + 1, 'context_length', ctx, 'closed', 0,
    'gen', 0, 'reset_pending', 0, 'retention', s[11] or 'full', 'result_window', s[12] or 1,
    'idle_timeout_ms', s[13] or 0, 'idle_closed', 0, 'cancels', 0, 'forked_from', session_id,
    'created_ms', now, 'updated_ms', now, 'priority', s[14] or 'bulk', 'trainer', trainer)
  if s[16] then
    redis.call('HSET', child, 'max_staleness', s[16])
  end
  if s[17] then
    redis.call('HSET', child, 'first_version', s[17])
  end
  for j = 1, #log, 2 do  -- a branch owns its blobs: a reset or close of one never touches another's
    local kind, sep, step = string.match(log[j], '^(%a+)([:@])(%-?%d+)$')
    if kind == 'result' and sep == '@' then  -- a slot of the window: the branch keeps the parent's steps
      step = slot_step(tonumber(step), committed, tonumber(s[12] or '1'))
    end
    if kind == 'result' and is_blob(log[j + 1]) then
      local blob = result_blob(child_log, step)
      redis.call('COPY', result_blob(log_key, step), blob, 'REPLACE')
      log[j + 1] = BLOB_MARK .. blob
    elseif kind == 'input' then  -- a record whose input is in its record blob (COPY: 0 when none)
      redis.call('COPY', record_blob(log_key, step), record_blob(child_log, step), 'REPLACE')
    end
  end
  for j = 1, #log, 1000 do  -- in slices: unpack of a whole long log would overflow Lua's stack
    redis.call('HSET', child_log, unpack(log, j, math.min(j + 999, #log)))
  end
  redis.call('HSET', sessions_key, ARGV[first_branch_id + i - 1], owner)
end
redis.call('HINCRBY', owned_key, owner, n)
redis.call('ZINCRBY', pool_key, n, owner)
if trainer ~= '' then
  redis.call('HINCRBY', trainer_open_key, trainer, n)
end
redis.call('XADD', inbox_key, '*',
  'kind', 'fork', 'job_id', '', 'session_id', session_id, 'step_id', committed, 'contextual', '1',
  'epoch', s[2], 'gen', s[7], 'mode', s[9], 'model', s[10], 'reply_to', '',
  'enqueued_ms', now, 'attempt', 0, 'payload', table.concat(ARGV, ' ', first_branch_id))
return {'forked', committed}
