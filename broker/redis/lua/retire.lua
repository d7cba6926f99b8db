-- Remove a worker that owns no sessions any more (dead, or drained): its heartbeat entry, its
-- capacity, its description, its pools and its inbox. Entries left in the inbox belong to no live
-- session; they go to the dead-letter stream with the reason 'orphaned', never silently away.
-- Uses: prelude.lua (now_ms, BLOB_MARK, unpacked_entry)
-- KEYS: 1 workers zset, 2 capacity hash, 3 worker hash, 4 inbox, 5 dead-letter stream, 6 owned hash,
--       7 pressure hash, 8 .. 7 + ARGV 6: pools (the capacity hash's worker@pool fields go with
--       them), then the input blob (CellKeys.input_blob) of each inbox entry whose payload was
--       staged (broker/redis/inputs.py), as the caller found them reading the inbox just before
-- ARGV: 1 worker id, 2 lease ms, 3 reason ('expired'|'drained'), 4 dead-letter maxlen,
--       5 dead-letter payload budget in bytes (a larger payload is replaced by payload_dropped,
--       worded as broker.redis.layouts.dead_letter_payload words it), 6 the number of pools in
--       KEYS, 7.. the inbox entry id of each input blob in KEYS, in the same order: an orphan whose
--       payload was staged has its input blob read into the dead letter within that budget, and
--       deleted
-- An inbox entry with a staged payload whose blob the call does not list (it reached the inbox
-- after the caller read it) stops the call before any write: 'unlisted', read again and call again.
-- Fields (broker/redis/layouts.py DeadLetter): each orphan is dead-lettered as reason, worker_id,
--       failed_ms followed by the inbox entry's own fields (broker/redis/inbox.py), a packed entry's
--       unpacked (prelude.lua unpacked_entry: a replay of any release reads the letter)
-- Returns {'retired', orphans} | {'alive'} | {'unlisted'}
local workers_key = KEYS[1]
local capacity_key = KEYS[2]
local worker_key = KEYS[3]
local inbox_key = KEYS[4]
local dead_key = KEYS[5]
local owned_key = KEYS[6]
local pressure_key = KEYS[7]
local first_pool = 8
local worker_id = ARGV[1]
local lease = tonumber(ARGV[2])
local reason = ARGV[3]
local dead_maxlen = ARGV[4]
local budget_text = ARGV[5]
local budget = tonumber(budget_text)
local pool_count = tonumber(ARGV[6])
local first_blob_entry = 7
local last_pool = first_pool + pool_count - 1
local now = now_ms()
if reason == 'expired' then
  local hb = redis.call('ZSCORE', workers_key, worker_id)
  if hb and now - tonumber(hb) <= lease then
    return {'alive'}
  end
end
local blob_of = {}  -- inbox entry id -> its input blob, from KEYS
for i = last_pool + 1, #KEYS do
  blob_of[ARGV[first_blob_entry + i - last_pool - 1]] = KEYS[i]
end
local function payload_of(fields)
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'payload' then
      return fields[i + 1]
    end
  end
  return nil
end
local entries = redis.call('XRANGE', inbox_key, '-', '+')
for _, entry in ipairs(entries) do
  if payload_of(entry[2]) == BLOB_MARK and not blob_of[entry[1]] then
    return {'unlisted'}
  end
end
local orphans = 0
local function too_large(size)
  return 'payload too large to keep: ' .. size .. ' bytes, over the dead-letter budget of ' .. budget_text .. ' bytes'
end
-- An orphan's payload as its dead letter keeps it: the bytes, or '' and why not.
local function kept_payload(entry_id, payload)
  if payload ~= BLOB_MARK then
    if #payload > budget then
      return '', too_large(#payload)
    end
    return payload, nil
  end
  local blob = blob_of[entry_id]
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
for _, entry in ipairs(entries) do
  local fields = unpacked_entry(entry[2])
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'payload' then
      local why
      fields[i + 1], why = kept_payload(entry[1], fields[i + 1])
      if why then
        table.insert(fields, 'payload_dropped')
        table.insert(fields, why)
      end
    end
  end
  redis.call('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'reason', 'orphaned: its session no longer exists',
    'worker_id', worker_id, 'failed_ms', now, unpack(fields))
  orphans = orphans + 1
end
redis.call('ZREM', workers_key, worker_id)
redis.call('HDEL', capacity_key, worker_id)
redis.call('HDEL', owned_key, worker_id)
redis.call('HDEL', pressure_key, worker_id)
redis.call('DEL', worker_key, inbox_key)
for i = first_pool, last_pool do
  redis.call('ZREM', KEYS[i], worker_id)
  redis.call('HDEL', capacity_key, worker_id .. '@' .. KEYS[i])
end
return {'retired', orphans}
