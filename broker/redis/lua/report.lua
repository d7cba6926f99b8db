-- Publish an outcome that commits nothing (an error, a stateless result), fenced like a commit.
-- A contextual step's final failure lets the trainer retry the same step_id: next_step_id falls
-- back to committed+1 unless a newer generation (a reset or an earlier fallback) was enqueued.
-- A job that failed for good is also dead-lettered (atomically), with the reason and attempts.
-- Uses: prelude.lua (fenced, add_reply)
-- KEYS: 1 session hash, 2 inbox, 3 reply stream, 4 dead-letter stream, 5 the job's input blob
--       (CellKeys.input_blob: DELeted with the entry; a job whose payload was not staged has none),
--       and for a large result (broker/redis/blobs.py) 6 where it is staged (CellKeys.staged_reply;
--       ARGV 5 is then ''), 7 its reply blob: RENAMEd there, the entry refers to it; a fenced report
--       DELetes KEYS[6] and leaves KEYS[5] (the entry moved on with its session, the blob with it)
-- ARGV: 1 worker id, 2 job epoch, 3 inbox entry id, 4 job_id, 5 result, 6 fallback gen ('' = none),
--       7 reply ttl ms, 8 inbox group, 9 dead-letter maxlen, 10-12 reply stream bounds (ReplyBounds),
--       13.. dead-letter field/value pairs (none when the job is not dead-lettered; the payload
--       already cut to its budget by DeadLetter)
-- Fields (broker/redis/layouts.py): reads session owner, epoch, committed_step_id, gen; writes
--       session next_step_id, gen (fallback); adds a dead letter (DeadLetter.to_fields, ARGV 13..)
--       and a reply entry (kind, job_id, committed, result)
-- Returns {'published', committed} | {'fenced', owner, epoch}
--       | {'unstaged', committed} (KEYS[6] given and missing: nothing changed, call again)
local session_key = KEYS[1]
local inbox_key = KEYS[2]
local reply_key = KEYS[3]
local dead_key = KEYS[4]
local input_blob_key = KEYS[5]
local staged_key = KEYS[6]
local reply_blob_key = KEYS[7]
local worker_id = ARGV[1]
local job_epoch = ARGV[2]
local entry_id = ARGV[3]
local job_id = ARGV[4]
local result_arg = ARGV[5]
local fallback_gen = ARGV[6]
local reply_ttl_ms = ARGV[7]
local inbox_group = ARGV[8]
local dead_maxlen = ARGV[9]
local stream_bytes = ARGV[10]
local large_bytes = ARGV[11]
local large_ttl_ms = ARGV[12]
local first_dead_field = 13
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'gen')
local staged = #KEYS >= 7
if s[1] and fenced(s[1], s[2], worker_id, job_epoch) then
  if staged then
    redis.call('DEL', staged_key)
  end
  return {'fenced', s[1], s[2]}
end
local committed = tonumber(s[3] or '-1')
local result, size, blob = result_arg, nil, nil
if staged then
  if redis.call('EXISTS', staged_key) == 0 then
    return {'unstaged', committed}
  end
  redis.call('RENAME', staged_key, reply_blob_key)  -- its TTL is add_reply's: the stream's
  result, size, blob = BLOB_MARK .. reply_blob_key, redis.call('STRLEN', reply_blob_key), reply_blob_key
end
if s[1] and fallback_gen ~= '' and s[4] == fallback_gen then
  redis.call('HSET', session_key, 'next_step_id', committed + 1, 'gen', tonumber(s[4]) + 1)
end
if #ARGV >= first_dead_field then
  redis.call('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', unpack(ARGV, first_dead_field))
end
redis.call('XACK', inbox_key, inbox_group, entry_id)
redis.call('XDEL', inbox_key, entry_id)
redis.call('DEL', input_blob_key)
add_reply(reply_key, reply_ttl_ms, stream_bytes, large_bytes, large_ttl_ms, 'step', job_id, committed, result,
  size, blob)
return {'published', committed}
