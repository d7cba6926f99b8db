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
local s = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'committed_step_id', 'gen')
local staged = #KEYS >= 7
if s[1] and fenced(s[1], s[2], ARGV[1], ARGV[2]) then
  if staged then
    redis.call('DEL', KEYS[6])
  end
  return {'fenced', s[1], s[2]}
end
local committed = tonumber(s[3] or '-1')
local result, size, blob = ARGV[5], nil, nil
if staged then
  if redis.call('EXISTS', KEYS[6]) == 0 then
    return {'unstaged', committed}
  end
  redis.call('RENAME', KEYS[6], KEYS[7])  -- its TTL is add_reply's: the stream's
  result, size, blob = BLOB_MARK .. KEYS[7], redis.call('STRLEN', KEYS[7]), KEYS[7]
end
if s[1] and ARGV[6] ~= '' and s[4] == ARGV[6] then
  redis.call('HSET', KEYS[1], 'next_step_id', committed + 1, 'gen', tonumber(s[4]) + 1)
end
if #ARGV > 12 then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', unpack(ARGV, 13))
end
redis.call('XACK', KEYS[2], ARGV[8], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[5])
add_reply(KEYS[3], ARGV[7], ARGV[10], ARGV[11], ARGV[12], 'step', ARGV[4], committed, result, size, blob)
return {'published', committed}
