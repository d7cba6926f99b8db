-- Commit step k of a session: the exactly-once point. Fenced by owner and lease epoch.
-- Uses: prelude.lua (now_ms, fenced, add_reply, step_text, result_blob, record_blob, reply_value)
-- KEYS: 1 session hash, 2 log hash, 3 inbox, 4 reply stream, 5 staged result (CellKeys.staged_result),
--       6 this step's result blob, 7 this job's reply blob (broker/redis/blobs.py), and for a job
--       whose payload was staged (broker/redis/inputs.py) 8 its input blob, 9 this step's record blob
-- ARGV: 1 worker id, 2 job epoch, 3 step_id, 4 inbox entry id, 5 result, 6 context_length,
--       7 job_id, 8 reply ttl ms, 9 inbox group, 10 step record for context rebuild ('' = none),
--       11 records kept (-1 = all, N = the last N), 12-14 reply stream bounds (bytes, large result
--       bytes, large result ttl ms: ReplyBounds), 15 deferred ('1': durability=replicated, see below),
--       16 the policy version the step ran on ('' = not given)
-- A session with max_staleness records the version its trajectory's first committed step ran on
--       (first_version; a reset clears it) for the staleness check of enqueue.lua and the worker.
--       17 the job's cancel count ('' = not checked: a re-publish), 18 '1': the result is staged in
--       KEYS[5] (ARGV 5 is then ''), otherwise ''
-- Staged (large) results: the commit RENAMEs KEYS[5] to KEYS[6] and stores a reference to it; every
--       other outcome DELetes KEYS[5]. Neither path, nor a re-publish, reads blob bytes into Lua.
-- Staged inputs: the commit RENAMEs KEYS[8] to KEYS[9] when the step record is kept (the record's
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
--       max_staleness, first_version, cancels; writes first_version (when absent and max_staleness is set);
--       writes session committed_step_id, context_length, updated_ms, unconfirmed_step (deferred: the
--       lowest step committed and not yet confirmed; any publish clears it); log result:<step> (the
--       last result_window kept, a large one as a reference to its blob) and input:<step> (per
--       ARGV 11); adds a reply entry (kind, job_id, committed, result: a large one as a reference)
-- Returns {'committed'} | {'duplicate'} | {'duplicate_unstored', committed}
--       | {'fenced', owner, epoch} | {'out_of_order', committed} | {'cancelled', committed}
--       | {'unstaged', committed} (ARGV 18 '1' and KEYS[5] missing: nothing changed, call again)
local s = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'committed_step_id', 'result_window', 'unconfirmed_step',
  'max_staleness', 'first_version', 'cancels')
local staged = ARGV[18] == '1'
local function unstage()
  if staged then
    redis.call('DEL', KEYS[5])
  end
end
if fenced(s[1], s[2], ARGV[1], ARGV[2]) then
  unstage()
  return {'fenced', s[1] or '', s[2] or ''}
end
local step = tonumber(ARGV[3])
local committed = tonumber(s[3])
local deferred = ARGV[15] == '1'
local function publish(stored, current)
  local result, size, blob = reply_value(stored, KEYS[7])
  if not result then
    return false
  end
  if s[5] then  -- published after a replica confirmed every earlier write of this master
    redis.call('HDEL', KEYS[1], 'unconfirmed_step')
  end
  redis.call('XACK', KEYS[3], ARGV[9], ARGV[4])
  redis.call('XDEL', KEYS[3], ARGV[4])
  add_reply(KEYS[4], ARGV[8], ARGV[12], ARGV[13], ARGV[14], 'step', ARGV[7], current, result, size, blob)
  return true
end
if committed >= step then
  unstage()
  if KEYS[8] then
    redis.call('DEL', KEYS[8])
  end
  local stored = redis.call('HGET', KEYS[2], 'result:' .. step_text(step))
  if not stored then
    return {'duplicate_unstored', committed}
  end
  if deferred then
    redis.call('HSET', KEYS[2], 'result:' .. step_text(step), stored)
    return {'duplicate'}
  end
  if not publish(stored, committed) then  -- the reference outlived its blob: not stored either
    return {'duplicate_unstored', committed}
  end
  return {'duplicate'}
end
if ARGV[17] and ARGV[17] ~= '' and ARGV[17] ~= (s[8] or '0') then
  unstage()
  return {'cancelled', committed}
end
if committed ~= step - 1 or (ARGV[5] == '' and not staged) then  -- an empty result only re-publishes
  unstage()
  return {'out_of_order', committed}
end
local result = ARGV[5]
if staged then
  if redis.call('EXISTS', KEYS[5]) == 0 then
    return {'unstaged', committed}
  end
  redis.call('RENAME', KEYS[5], KEYS[6])
  redis.call('PERSIST', KEYS[6])  -- RENAME keeps the staging TTL: the blob lives as its log field does
  result = BLOB_MARK .. KEYS[6]
end
redis.call('HSET', KEYS[1], 'committed_step_id', step, 'context_length', ARGV[6], 'updated_ms', now_ms())
if s[6] and not s[7] and ARGV[16] and ARGV[16] ~= '' then
  redis.call('HSET', KEYS[1], 'first_version', ARGV[16])
end
redis.call('HSET', KEYS[2], 'result:' .. step_text(step), result)
local window = tonumber(s[4] or '1')
if step - window >= 0 then
  redis.call('HDEL', KEYS[2], 'result:' .. step_text(step - window))
  redis.call('DEL', result_blob(KEYS[2], step - window))
end
local keep = tonumber(ARGV[11])
if ARGV[10] ~= '' and keep ~= 0 then
  redis.call('HSET', KEYS[2], 'input:' .. step_text(step), ARGV[10])
  if KEYS[8] and redis.call('EXISTS', KEYS[8]) == 1 then
    redis.call('RENAME', KEYS[8], KEYS[9])
  end
  if keep > 0 and step - keep >= 0 then
    redis.call('HDEL', KEYS[2], 'input:' .. step_text(step - keep))
    redis.call('DEL', record_blob(KEYS[2], step - keep))
  end
elseif KEYS[8] then
  redis.call('DEL', KEYS[8])
end
if deferred then
  local unconfirmed = tonumber(s[5])
  if not unconfirmed or step < unconfirmed then
    redis.call('HSET', KEYS[1], 'unconfirmed_step', step)
  end
  return {'committed'}
end
publish(result, step)
return {'committed'}
