-- Enqueue one step job into its owner's inbox, enforcing the step-id rules atomically.
-- Uses: prelude.lua (now_text, session_refusal, step_text, BLOB_MARK, stored_result, PACKED_FIELD,
--       reads_packed)
-- A session with max_staleness refuses a new contextual step with stale_policy once the version
-- announced for its model passed first_version + max_staleness (docs/async_rl.md); nothing changes.
-- KEYS: 1 session hash, 2 inbox of the owner the client believes in, 3 log hash, 4 announced hash
--       (model -> highest announced policy version), 5 that owner's worker hash (read for the layout
--       of the entry: see below), and for a large payload (broker/redis/inputs.py) 6 where the client
--       staged it (CellKeys.staged_input), 7 the job's input blob (CellKeys.input_blob)
-- ARGV: 1 step_id, 2 job_id, 3 payload ('' when staged), 4 session_id, 5 believed owner, 6 attempt,
--       7 minimum policy version, 8 contextual ('1'|'0'), 9 reply_to: those that vary from step to
--       step first, those that repeat through a client's batch last (prelude.lua run_batch sends
--       the trailing ones a batch's calls share once)
-- Staged (large) payloads: a queued step RENAMEs KEYS[6] to KEYS[7] (no TTL: the blob lives as long
--       as the entry; whoever ends the entry deletes it) and its entry's payload is BLOB_MARK alone;
--       every other reply DELetes KEYS[6]. The bytes never enter Lua.
-- Fields (broker/redis/layouts.py, inbox.py): reads session owner, epoch, committed_step_id,
--       next_step_id, context_length, closed, gen, reset_pending, mode, model, retention,
--       max_staleness, first_version, priority, unconfirmed_step (a committed step no replica has
--       confirmed yet, commit.lua: a re-sent step from there on is queued for its owner, who
--       answers it once a replica has it), and for a re-sent committed step result_window and its
--       stored result (prelude.lua stored_result); writes session next_step_id and updated_ms (a
--       step is activity: the idle timeout starts again); reads announced <model>; adds an inbox
--       entry (kind, job_id, session_id, step_id, contextual, epoch, gen, mode, model, reply_to,
--       enqueued_ms, attempt, retention, min_version, priority (the worker serves interactive steps
--       first), cancels (the session's cancel count: commit.lua refuses the step once a cancel
--       raised it), payload); retention, min_version, priority and cancels are left out when all
--       four hold their defaults (full, 0, bulk, 0), as the worker reads a missing one. For an owner
--       whose worker hash says it reads one (prelude.lua reads_packed, once per owner per call), the entry is
--       packed (broker/redis/inbox.py): kind, step_id, contextual, gen, mode, enqueued_ms, attempt and
--       model joined into PACKED_FIELD, the other fields as above
-- Returns {'queued', entry_id, committed} | {'stored', result, committed}
--       | {'error', code, message, committed, context_length[, 'in_flight']} | {'moved', owner}
--       | {'unstaged', committed} (KEYS[6] given and missing: nothing changed, call again)
-- Batch (prelude.lua run_batch; Scripts sends the enqueues of one event-loop turn so): each runs as
--       above and answers in its place; the batch reads TIME once, and each owner's worker hash once.


-- One enqueue, with a staged payload (staged_input_key) still where the client put it: queued (and
-- the payload renamed to input_blob_key) or refused. A function of named values, not a closure over
-- enqueue_one's locals: a closure made per step costs its master more than its call does.
local function enqueue_step(session_key, inbox_key, log_key, announced_key, owner_key, staged_input_key,
                            input_blob_key, believed_owner, step_id, contextual, job_id, reply_to, inline_payload,
                            session_id, attempt, min_version, staged)
  local step = tonumber(step_id)  -- for comparisons only: above 2^53 the double is rounded
  local advanced = nil  -- next_step_id after this step (decimal text), written with updated_ms
  local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'next_step_id',
    'context_length', 'closed', 'gen', 'reset_pending', 'mode', 'model', 'retention', 'unconfirmed_step',
    'max_staleness', 'first_version', 'priority', 'cancels')
  local owner, committed, ctx = s[1], tonumber(s[3]), s[5]
  local refusal = session_refusal(owner, s[6], committed, ctx, believed_owner, session_id)
  if refusal then
    return refusal
  end
  local unconfirmed = tonumber(s[12] or '')
  local awaits_replica = contextual == '1' and unconfirmed ~= nil and step >= unconfirmed and step <= committed
    and s[8] == '0'
  if contextual == '1' and not awaits_replica then
    local nxt = tonumber(s[4])
    -- Any step of a trajectory past its bound, in order or not: not a re-sent committed one (its
    -- stored result still answers) nor one behind a pending reset (it starts a new trajectory).
    if s[13] and s[14] and step > committed and s[8] == '0' then
      local announced = tonumber(redis.call('HGET', announced_key, s[10]) or '0') or 0
      local first = tonumber(s[14])
      if announced > first + tonumber(s[13]) then
        return {'error', 'stale_policy', 'the trajectory started on policy version ' .. step_text(first)
          .. ' and version ' .. step_text(announced) .. ' of ' .. s[10] .. ' is announced, more than max_staleness '
          .. s[13] .. ' ahead: drop the trajectory or reset the session', committed, ctx}
      end
    end
    if step ~= nxt then
      if step <= committed and s[8] == '0' then
        local window = tonumber(redis.call('HGET', session_key, 'result_window') or '1')  -- a re-send only
        local stored = stored_result(log_key, step, committed, window)
        if stored then
          return {'stored', stored, committed}
        end
        return {'error', 'step_already_committed',
                'Step ' .. step_id .. ' is already committed; highest committed step is ' .. step_text(committed) .. '.',
                committed, ctx}
      end
      if step < nxt then
        return {'error', 'step_out_of_order',
                'step ' .. step_id .. ' is already queued; expected step_id ' .. step_text(nxt), committed, ctx, 'in_flight'}
      end
      return {'error', 'step_out_of_order', 'Expected step_id ' .. step_text(nxt) .. ', got ' .. step_id .. '.', committed, ctx}
    end
    advanced = step_text(nxt + 1)
  end
  local now = now_text()
  if advanced then
    redis.call('HSET', session_key, 'next_step_id', advanced, 'updated_ms', now)
  else
    redis.call('HSET', session_key, 'updated_ms', now)
  end
  local payload = inline_payload
  if staged then
    redis.call('RENAME', staged_input_key, input_blob_key)
    redis.call('PERSIST', input_blob_key)
    payload = BLOB_MARK
  end
  local retention, priority, cancels = s[11] or 'full', s[15] or 'bulk', s[16] or '0'
  min_version = min_version or '0'
  local packs = reads_packed(owner_key)
  local defaults = retention == 'full' and priority == 'bulk' and cancels == '0' and min_version == '0'
  -- Literal XADDs rather than one whose arguments are built in a table: a table per step costs the
  -- master more than the fields it saves. The common step leaves its four default fields out (the
  -- worker reads them as these defaults): a smaller entry to write, keep and send.
  local id
  if packs then
    local packed = 'step\0' .. step_id .. '\0' .. contextual .. '\0' .. s[7] .. '\0' .. s[9] .. '\0' .. now
      .. '\0' .. attempt .. '\0' .. s[10]
    if defaults then
      id = redis.call('XADD', inbox_key, '*', 'session_id', session_id, 'epoch', s[2], 'job_id', job_id,
        'reply_to', reply_to, PACKED_FIELD, packed, 'payload', payload)
    else
      id = redis.call('XADD', inbox_key, '*', 'session_id', session_id, 'epoch', s[2], 'job_id', job_id,
        'reply_to', reply_to, PACKED_FIELD, packed, 'retention', retention, 'min_version', min_version,
        'priority', priority, 'cancels', cancels, 'payload', payload)
    end
  elseif defaults then
    id = redis.call('XADD', inbox_key, '*',
      'kind', 'step', 'job_id', job_id, 'session_id', session_id, 'step_id', step_id,
      'contextual', contextual, 'epoch', s[2], 'gen', s[7], 'mode', s[9], 'model', s[10],
      'reply_to', reply_to, 'enqueued_ms', now, 'attempt', attempt, 'payload', payload)
  else
    id = redis.call('XADD', inbox_key, '*',
      'kind', 'step', 'job_id', job_id, 'session_id', session_id, 'step_id', step_id,
      'contextual', contextual, 'epoch', s[2], 'gen', s[7], 'mode', s[9], 'model', s[10],
      'reply_to', reply_to, 'enqueued_ms', now, 'attempt', attempt, 'retention', retention,
      'min_version', min_version, 'priority', priority, 'cancels', cancels, 'payload', payload)
  end
  return {'queued', id, committed}
end

local function enqueue_one(KEYS, ARGV)
  local session_key = KEYS[1]
  local inbox_key = KEYS[2]
  local log_key = KEYS[3]
  local announced_key = KEYS[4]
  local owner_key = KEYS[5]
  local staged_input_key = KEYS[6]
  local input_blob_key = KEYS[7]
  local step_id = ARGV[1]  -- the id exactly as the client sent it (decimal text), written back as is
  local job_id = ARGV[2]
  local inline_payload = ARGV[3]
  local session_id = ARGV[4]
  local believed_owner = ARGV[5]
  local attempt = ARGV[6]
  local min_version = ARGV[7]
  local contextual = ARGV[8]
  local reply_to = ARGV[9]
  local staged = #KEYS >= 7
  if staged and redis.call('EXISTS', staged_input_key) == 0 then
    return {'unstaged', -1}
  end
  local reply = enqueue_step(session_key, inbox_key, log_key, announced_key, owner_key, staged_input_key,
    input_blob_key, believed_owner, step_id, contextual, job_id, reply_to, inline_payload, session_id, attempt,
    min_version, staged)
  if staged and reply[1] ~= 'queued' then
    redis.call('DEL', staged_input_key)
  end
  return reply
end

if not is_batch() then
  return enqueue_one(KEYS, ARGV)
end
return run_batch(enqueue_one)
