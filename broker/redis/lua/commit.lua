-- Commit step k of a session: the exactly-once point. Fenced by owner and lease epoch.
-- Uses: prelude.lua (now_text, now_from_id, fenced, add_reply, step_text, result_blob, reply_value,
--       result_field, stored_result, memo_number, IN_PLACE_MARK, in_place_marker, in_place_reader,
--       reply_ttl, hand_over_or)
-- KEYS: 1 session hash, 2 log hash, 3 inbox, 4 reply stream, 5 this job's reply blob
--       (broker/redis/blobs.py: a stored result that is a blob is copied there, also by a duplicate),
--       and only when the call needs them (Scripts._commit_call): 6 staged result
--       (CellKeys.staged_result), 7 this step's result blob (both for a staged result: ARGV 9 '1'),
--       8 the record blob that falls out of the records kept (CellKeys.record_blob of
--       step_id - ARGV 12; when ARGV 12 > 0), and for a job whose payload was staged
--       (broker/redis/inputs.py) 9 its input blob, 10 this step's record blob. A call passes 5, 8 or
--       10 KEYS: the common commit (an inline result, records kept all or none, an inline payload)
--       passes 5, so its master interns no key it never touches.
-- Derived keys (docs/architecture.md, "Keys"): the result blob that falls out of the result window,
--       result_blob(KEYS[2], committed + 1 - result_window), both read from the session hash, so
--       the caller cannot name it, and its in-place marker (prelude.lua in_place_marker); each is
--       the log key's name plus a suffix, in its hash tag and slot. This step's marker is KEYS[7]'s
--       name plus a suffix, and the reply stream's in-place reader key (prelude.lua
--       in_place_reader) KEYS[4]'s.
-- ARGV: 1 step_id, 2 inbox entry id, 3 job_id, 4 result, 5 context_length, 6 step record for
--       context rebuild ('' = none), 7 job epoch, 8 the job's cancel count ('' = not checked: a
--       re-publish), 9 '1': the result is staged in KEYS[6] (ARGV 4 is then ''), otherwise '',
--       10 the policy version the step ran on ('' = not given), 11 deferred ('1':
--       durability=replicated, see below), 12 records kept (-1 = all, N = the last N), 13 reply ttl
--       ms, 14-16 reply stream bounds (bytes, large result bytes, large result ttl ms: ReplyBounds),
--       17 inbox group, 18 worker id: those that vary from step to step first, those that repeat
--       through a worker's batch last (prelude.lua run_batch sends the trailing ones a batch's
--       calls share once)
-- A session with max_staleness records the version its trajectory's first committed step ran on
--       (first_version; a reset clears it) for the staleness check of enqueue.lua and the worker.
-- Staged (large) results: the commit RENAMEs KEYS[6] to KEYS[7] and stores a reference to it; every
--       other outcome DELetes KEYS[6]. Neither path, nor a re-publish, reads blob bytes into Lua.
--       The reply refers to KEYS[7] in place when the reply stream's reader reads in place (its
--       in_place_reader key stands) or to a COPY of it in KEYS[5] (a re-publish always copies: the
--       step may leave the window before it is read). A result blob that falls out of the window
--       goes to the reader of its unread in-place reply (prelude.lua hand_over_or).
-- Staged inputs: the commit RENAMEs KEYS[9] to KEYS[10] when the step record is kept (the record's
--       payload then says so) and DELetes it otherwise, as does a duplicate (the step never runs
--       again); a fenced, cancelled or out-of-order call leaves it to whoever ends the entry.
-- Cancel (cancel.lua): a step enqueued before the session's last cancel never commits; a step
--       committed before the cancel stays committed (its duplicates re-publish as usual).
-- Deferred (replicated durability, broker/redis/durability.py): the commit is written but the job
--       stays pending and nothing is published; the session's unconfirmed_step marks it, so a
--       re-sent step goes to the owner (enqueue.lua) instead of reading an unconfirmed result. A
--       deferred duplicate rewrites its stored result, a write that makes the WAIT after this call
--       cover the commit even when another connection wrote it. The worker calls again with
--       deferred '0' and an empty result once a replica has it: that call publishes and acks.
-- Fields (broker/redis/layouts.py): reads session owner, epoch, committed_step_id, result_window,
--       max_staleness, first_version, cancels, next_step_id, reset_pending, last_blob_step (the highest
--       step committed with its result in a blob: a token session's eviction then deletes no blob;
--       absent means unknown); writes last_blob_step with a blob's commit; writes first_version (when
--       absent and max_staleness is set); writes session next_step_id (raised to step + 1 when it is not
--       past the step and no reset is pending: see below), committed_step_id, context_length,
--       updated_ms, unconfirmed_step (deferred: the lowest step committed and not yet confirmed; any
--       publish clears it); log result@<slot> (the result window as a ring, prelude.lua
--       result_field: the step's result overwrites the one that falls out; a large one as a
--       reference to its blob) and input:<step> (per ARGV 12); adds a reply entry (kind, job_id,
--       committed, result: a large one as a reference)
-- Returns {'committed'} | {'duplicate'} | {'duplicate_unstored', committed}
--       | {'fenced', owner, epoch} | {'out_of_order', committed} | {'cancelled', committed}
--       | {'unstaged', committed} (ARGV 9 '1' and KEYS[6] missing: nothing changed, call again)
-- Batch (prelude.lua run_batch; Scripts sends the commits of one event-loop turn so): each commit
--       runs as above and answers in its place; the inbox entries they publish are acknowledged and
--       deleted with one XACK and one XDEL per inbox at the end, each reply stream's length is read
--       once and its TTL set once, and the batch reads TIME once.

-- commit_one's helpers: functions of named values, not closures over its locals (a closure made per
-- commit costs its master more than its call does).
-- Drop a staged result (staged_key, when staged) that the call does not commit.
local function unstage(staged, staged_key)
  if staged then
    redis.call('DEL', staged_key)
  end
end
-- Publish a stored result: acknowledge the inbox entry and add the reply entry (`current`: the
-- committed step it carries). False when a stored reference outlived its blob (nothing done).
-- `unconfirmed`: the session's unconfirmed_step as read. `in_place_blob`: the result blob the reply
-- refers to in place (its marker set here), or nil.
local function publish(stored, current, unconfirmed, session_key, inbox_key, inbox_group, entry_id, reply_key,
                       reply_blob_key, job_id, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms, in_place_blob)
  local result, size, blob
  if in_place_blob then
    size = redis.call('STRLEN', in_place_blob)
    result = IN_PLACE_MARK .. in_place_blob .. '\0' .. reply_blob_key
    local marker = in_place_marker(in_place_blob)
    redis.call('HSET', marker, reply_blob_key, '1')
    redis.call('PEXPIRE', marker, reply_ttl(size, reply_ttl_ms, large_bytes, large_ttl_ms))
  else
    result, size, blob = reply_value(stored, reply_blob_key)
    if not result then
      return false
    end
  end
  if unconfirmed then  -- published after a replica confirmed every earlier write of this master
    redis.call('HDEL', session_key, 'unconfirmed_step')
  end
  if batch_state then  -- one XACK and one XDEL per inbox for the whole batch (at the end of the script)
    local ids = batch_state.acks[inbox_key]
    if not ids then
      ids = {}
      batch_state.acks[inbox_key] = ids
      batch_state.groups[inbox_key] = inbox_group
    end
    ids[#ids + 1] = entry_id
  else
    redis.call('XACK', inbox_key, inbox_group, entry_id)
    redis.call('XDEL', inbox_key, entry_id)
  end
  return add_reply(reply_key, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms, 'step', job_id, current,
    result, size, blob, batch_state and batch_state.streams)
end

local function commit_one(KEYS, ARGV)
  local session_key = KEYS[1]
  local log_key = KEYS[2]
  local inbox_key = KEYS[3]
  local reply_key = KEYS[4]
  local reply_blob_key = KEYS[5]
  local staged_key = KEYS[6]  -- nil unless the result is staged or records are kept by count
  local result_blob_key = KEYS[7]
  local evicted_record_key = KEYS[8]
  local input_key = KEYS[9]  -- nil unless the job's payload was staged
  local record_key = KEYS[10]
  local step_id = ARGV[1]  -- the step as decimal text, written back as it is
  local step = tonumber(step_id)
  local entry_id = ARGV[2]
  local job_id = ARGV[3]
  local result_arg = ARGV[4]
  local context_length = ARGV[5]
  local record = ARGV[6]
  local job_epoch = ARGV[7]
  local job_cancels = ARGV[8]
  local staged = ARGV[9] == '1'
  local version = ARGV[10]
  local deferred = ARGV[11] == '1'
  local keep = memo_number(ARGV[12])
  local reply_ttl_ms = ARGV[13]
  local stream_bytes = ARGV[14]
  local large_bytes = ARGV[15]
  local large_ttl_ms = ARGV[16]
  local inbox_group = ARGV[17]
  local worker_id = ARGV[18]
  if (staged or keep > 0) and not evicted_record_key then  -- before any write: the caller's bug, said so
    return redis.error_reply('ERR commit.lua: a staged result or records kept by count need KEYS 6-8')
  end
  local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'result_window', 'unconfirmed_step',
    'max_staleness', 'first_version', 'cancels', 'next_step_id', 'reset_pending', 'last_blob_step')
  if fenced(s[1], s[2], worker_id, job_epoch) then
    unstage(staged, staged_key)
    return {'fenced', s[1] or '', s[2] or ''}
  end
  local committed = tonumber(s[3])
  local window = memo_number(s[4] or '1')
  if committed >= step then
    unstage(staged, staged_key)
    if input_key then
      redis.call('DEL', input_key)
    end
    local stored = stored_result(log_key, step, committed, window)
    if not stored then
      return {'duplicate_unstored', committed}
    end
    if deferred then
      redis.call('HSET', log_key, result_field(step, window), stored)
      return {'duplicate'}
    end
    -- false: the reference outlived its blob, so it is not stored either
    if not publish(stored, s[3], s[5], session_key, inbox_key, inbox_group, entry_id, reply_key, reply_blob_key,
      job_id, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms) then
      return {'duplicate_unstored', committed}
    end
    return {'duplicate'}
  end
  if job_cancels and job_cancels ~= '' and job_cancels ~= (s[8] or '0') then
    unstage(staged, staged_key)
    return {'cancelled', committed}
  end
  if committed ~= step - 1 or (result_arg == '' and not staged) then  -- an empty result only re-publishes
    unstage(staged, staged_key)
    return {'out_of_order', committed}
  end
  local result = result_arg
  -- the session hash's writes of this commit, in one HSET after the publish: its updated_ms is the
  -- reply entry's id (the server's clock when it was added), so a published commit reads no TIME
  local fields = {'committed_step_id', step_id, 'context_length', context_length}
  if staged then
    if redis.call('EXISTS', staged_key) == 0 then
      return {'unstaged', committed}
    end
    redis.call('RENAME', staged_key, result_blob_key)
    redis.call('PERSIST', result_blob_key)  -- RENAME keeps the staging TTL: the blob lives as its log field does
    result = BLOB_MARK .. result_blob_key
    fields[#fields + 1], fields[#fields + 2] = 'last_blob_step', step_id
  end
  -- A step committed here was enqueued, but this master may not have its enqueue: a replica promoted
  -- after the old master took the enqueue alone, the commit written again here by the worker that
  -- ran it. The session then expects this step next for ever (every later step is out of order, the
  -- step itself answers its stored result): it expects the one after it instead. Not while a reset
  -- is queued behind this step: its enqueue already moved next_step_id to the new generation's 0.
  if (memo_number(s[10]) or 0) == 0 and (tonumber(s[9]) or 0) <= step then
    fields[#fields + 1], fields[#fields + 2] = 'next_step_id', step_text(step + 1)
  end
  if s[6] and not s[7] and version and version ~= '' then
    fields[#fields + 1], fields[#fields + 2] = 'first_version', version
  end
  -- the log: this step's result (in the slot of the one that falls out) and record in one HSET,
  -- the record that falls out of the records kept in an HDEL
  local keeps_record = record ~= '' and keep ~= 0
  if keeps_record then
    redis.call('HSET', log_key, result_field(step, window), result, 'input:' .. step_id, record)
  else
    redis.call('HSET', log_key, result_field(step, window), result)
  end
  if step - window >= 0 then
    -- the blob of the result that falls out, unless no result from that step on was stored as one
    -- (last_blob_step: the highest step committed with a blob; absent, as in a forked session, means
    -- unknown)
    local last_blob = memo_number(s[11] or '')  -- -1 for a session that never stored a blob
    if last_blob == nil or last_blob >= step - window then
      hand_over_or(result_blob(log_key, committed + 1 - window), delete_key)  -- committed is step - 1 here
    end
  end
  if keeps_record then
    if input_key and redis.call('EXISTS', input_key) == 1 then
      redis.call('RENAME', input_key, record_key)
    end
    if keep > 0 and step - keep >= 0 then
      redis.call('HDEL', log_key, 'input:' .. step_text(step - keep))
      redis.call('DEL', evicted_record_key)
    end
  elseif input_key then
    redis.call('DEL', input_key)
  end
  if deferred then
    local unconfirmed = tonumber(s[5])
    if not unconfirmed or step < unconfirmed then
      fields[#fields + 1], fields[#fields + 2] = 'unconfirmed_step', step_id
    end
    redis.call('HSET', session_key, 'updated_ms', now_text(), unpack(fields))
    return {'committed'}
  end
  local in_place_blob = nil  -- the blob the reply refers to in place, when its reader reads so
  if staged and redis.call('EXISTS', in_place_reader(reply_key)) == 1 then
    in_place_blob = result_blob_key
  end
  local id = publish(result, step_id, s[5], session_key, inbox_key, inbox_group, entry_id, reply_key,
    reply_blob_key, job_id, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms, in_place_blob)
  if id then
    now_from_id(id)
  end
  redis.call('HSET', session_key, 'updated_ms', now_text(), unpack(fields))
  return {'committed'}
end

if not is_batch() then
  return commit_one(KEYS, ARGV)
end
batch_state = {acks = {}, groups = {}, streams = {}}
local replies = run_batch(commit_one)
for inbox_key, ids in pairs(batch_state.acks) do
  redis.call('XACK', inbox_key, batch_state.groups[inbox_key], unpack(ids))
  redis.call('XDEL', inbox_key, unpack(ids))
end
flush_replies(batch_state.streams)
return replies
