-- Remove a worker that owns no sessions any more (dead, or drained): its heartbeat entry, its
-- capacity, its description, its pools and its inbox. Entries left in the inbox belong to no live
-- session; they go to the dead-letter stream with the reason 'orphaned', never silently away.
-- Uses: prelude.lua (now_ms, input_blob, BLOB_MARK)
-- KEYS: 1 workers zset, 2 capacity hash, 3 worker hash, 4 inbox, 5 dead-letter stream, 6 owned hash,
--       7 pressure hash, 8.. pools (the capacity hash's worker@pool fields go with them)
-- ARGV: 1 worker id, 2 lease ms, 3 reason ('expired'|'drained'), 4 dead-letter maxlen,
--       5 dead-letter payload budget in bytes (a larger payload is replaced by payload_dropped,
--       worded as broker.redis.layouts.dead_letter_payload words it), 6 the log keys' prefix
--       (CellKeys.log('')): an orphan whose payload was staged (broker/redis/inputs.py) has its
--       input blob read into the dead letter within that budget, and deleted
-- Fields (broker/redis/layouts.py DeadLetter): each orphan is dead-lettered as reason, worker_id,
--       failed_ms followed by the inbox entry's own fields (broker/redis/inbox.py)
-- Returns {'retired', orphans} | {'alive'}
local now = now_ms()
if ARGV[3] == 'expired' then
  local hb = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if hb and now - tonumber(hb) <= tonumber(ARGV[2]) then
    return {'alive'}
  end
end
local orphans = 0
local budget = tonumber(ARGV[5])
local function too_large(size)
  return 'payload too large to keep: ' .. size .. ' bytes, over the dead-letter budget of ' .. ARGV[5] .. ' bytes'
end
-- An orphan's payload as its dead letter keeps it: the bytes, or '' and why not.
local function kept_payload(fields, payload)
  if payload ~= BLOB_MARK then
    if #payload > budget then
      return '', too_large(#payload)
    end
    return payload, nil
  end
  local session, job = '', ''
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'session_id' then session = fields[i + 1] end
    if fields[i] == 'job_id' then job = fields[i + 1] end
  end
  local blob = input_blob(ARGV[6] .. session, job)
  local size = redis.call('STRLEN', blob)
  local kept, why = '', nil
  if redis.call('EXISTS', blob) == 0 then
    why = 'its staged payload was gone'
  elseif size > budget then
    why = too_large(size)
  else
    kept = redis.call('GET', blob)
  end
  redis.call('DEL', blob)
  return kept, why
end
for _, entry in ipairs(redis.call('XRANGE', KEYS[4], '-', '+')) do
  local fields = entry[2]
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'payload' then
      local why
      fields[i + 1], why = kept_payload(fields, fields[i + 1])
      if why then
        table.insert(fields, 'payload_dropped')
        table.insert(fields, why)
      end
    end
  end
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'reason', 'orphaned: its session no longer exists',
    'worker_id', ARGV[1], 'failed_ms', now, unpack(fields))
  orphans = orphans + 1
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4])
for i = 8, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1] .. '@' .. KEYS[i])
end
return {'retired', orphans}
