-- prelude.lua: the idioms several scripts share, written once. Redis has no include, so
-- broker.redis.scripts.lua_source prepends this file to every script whose header says
-- "Uses: prelude.lua"; each script stays one file. Only the declarations a script names (and
-- those they name) go with it (broker/redis/lua_files.py prelude_for): each runs on every call.
-- So every top-level statement here is a local declaration, with the comment above it.

-- Redis server time in ms (TIME answers seconds and microseconds): one clock for every worker.
-- Read once per script call: a batch of steps (commit.lua, enqueue.lua) runs at one instant.
-- now_text() is the same instant as decimal text, made once: a number passed to redis.call is
-- printed with '%.17g' each time, text is passed as it is.
local now_cache, now_text_cache = nil, nil
local function now_ms()
  if not now_cache then
    local t = redis.call('TIME')
    now_cache = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_cache
end
local function now_text()
  if not now_text_cache then
    now_text_cache = string.format('%d', now_ms())
  end
  return now_text_cache
end

-- The server's clock as a stream entry id just added gives it (<ms>-<seq>): a script that added one
-- needs no TIME. Only while no TIME was read: the clock a script reads stays one.
local function now_from_id(id)
  if not now_cache then
    now_text_cache = string.match(id, '^(%d+)-')
    now_cache = tonumber(now_text_cache)
  end
end

-- tonumber of a text that repeats through one script call (a batch's key and argument counts, its
-- reply bounds and TTLs, a session's result window): parsed once per call. tonumber goes through
-- strtod, ~1,000 instructions a call, and a batch of 8 commits passes the same few texts 8 times.
-- The same value as tonumber (nil for nil or a text that is no number).
local number_memo = {}
local function memo_number(text)
  local n = number_memo[text]
  if n == nil then
    n = tonumber(text)
    if n ~= nil then
      number_memo[text] = n
    end
  end
  return n
end

-- A batch call (commit.lua, enqueue.lua): its calls have one shape (as many KEYS and as many
-- ARGV each), and what is the same in all of them is sent once. ARGV is BATCH_MARK, the number of
-- calls, each call's number of KEYS, its number of ARGV of its own, the number S of ARGV the calls
-- share, those S, then per call its own ARGV; KEYS are the calls' KEYS one after the other. A call's
-- ARGV are its own followed by the shared ones: a script orders its ARGV so that those that vary
-- from step to step come first and those that repeat through a batch (a worker's id, the reply
-- bounds) last, and broker/redis/scripts.py sends the longest run of equal trailing ARGV once.
-- Each shared text then enters the master once per batch instead of once per call.
-- `one(keys, argv)` runs one call as the script runs it alone; a call that raises answers its error
-- in its place, and the calls after it still run. The reply is the list of the calls' replies.
-- Calls in one batch touch one cell (one hash tag), as one call does.
-- `batch_state`: what a batch's calls share (commit.lua: the entries to acknowledge per inbox,
-- the reply streams' lengths and TTLs); nil outside a batch.
local BATCH_MARK, BATCH_MARK_AT, BATCH_COUNT_AT = '\0batch', 1, 2
local batch_state = nil
local function is_batch()
  return ARGV[BATCH_MARK_AT] == BATCH_MARK
end
local function run_batch(one)
  local replies = {}
  local count, nkeys = memo_number(ARGV[BATCH_COUNT_AT]), memo_number(ARGV[BATCH_COUNT_AT + 1])
  local nown, nshared = memo_number(ARGV[BATCH_COUNT_AT + 2]), memo_number(ARGV[BATCH_COUNT_AT + 3])
  local shared_at = BATCH_COUNT_AT + 4
  local shared = {}  -- a call's ARGV past its own, by position: every call reads them through __index
  for j = 1, nshared do
    shared[nown + j] = ARGV[shared_at + j - 1]
  end
  local with_shared = {__index = shared}
  local key_at, arg_at = 1, shared_at + nshared
  for nth = 1, count do
    local call_keys = {unpack(KEYS, key_at, key_at + nkeys - 1)}
    local call_args = setmetatable({unpack(ARGV, arg_at, arg_at + nown - 1)}, with_shared)
    key_at, arg_at = key_at + nkeys, arg_at + nown
    local ok, reply = pcall(one, call_keys, call_args)
    if ok or (type(reply) == 'table' and reply.err) then
      replies[nth] = reply
    else
      replies[nth] = {err = tostring(reply)}
    end
  end
  return replies
end

-- A step id the scripts computed or read (committed, next) as exact decimal text. Those stay
-- below 2^53 (schemas.limits.LUA_EXACT_STEPS), so the double Lua holds is exact, but `..`
-- prints a number with 14 significant digits ('1e+14'): a step id joined to text (a log field name, a message) goes through this instead.
local function step_text(step)
  return string.format('%d', step)
end

-- Large results (broker/redis/blobs.py): a stored result may be a reference, the bytes 0xc1 0x00
-- (0xc1 is never the first byte of msgpack; a schemas.codec frame starts 0xc1 then its version,
-- never 0) and then a key name. The bytes stay in that key: a script moves them
-- with RENAME / COPY and never reads them into Lua, which costs ~1.4 us per KiB.
local BLOB_MARK = '\193\0'
local function is_blob(value)
  return string.sub(value, 1, #BLOB_MARK) == BLOB_MARK
end

-- A key of one step (a number or decimal text) of the session whose log hash is `log_key`, built
-- from a key the caller passed in KEYS, so it shares that key's hash tag and slot: `kind` 'blob' is
-- the step's large result (CellKeys.result_blob), 'inrec' the staged input of its record
-- (CellKeys.record_blob, broker/redis/inputs.py). Only for a step the caller cannot name before
-- the call, because the script reads it (docs/architecture.md, "Keys in Lua scripts"); a key the
-- caller can name comes in KEYS.
local function log_step_key(log_key, kind, step)
  if type(step) == 'number' then
    step = step_text(step)
  end
  return log_key .. ':' .. kind .. ':' .. step
end
local function result_blob(log_key, step)
  return log_step_key(log_key, 'blob', step)
end
local function record_blob(log_key, step)
  return log_step_key(log_key, 'inrec', step)
end

-- The result window (layouts.py log_result_field): a ring of result_window fields, result@<slot>,
-- a step's result in slot step mod result_window. A commit overwrites the slot of the step that
-- falls out of the window (no HDEL); a reader checks that the step is still inside the window,
-- since its slot then holds a later step's result. The slot's step follows from the session's
-- committed step: the one step of the window (committed - window, committed] with that remainder.
-- math.fmod is exact for doubles (Lua's % is a - floor(a/b)*b, whose division rounds near 2^53).
local function remainder(a, b)
  local r = math.fmod(a, b)
  if r < 0 then
    r = r + b
  end
  return r
end
local function result_field(step, window)
  return 'result@' .. step_text(remainder(step, window))
end
local function slot_step(slot, committed, window)
  return committed - remainder(committed - slot, window)
end
-- The stored result of a committed step (nil once it fell out of the window); a log written
-- before the ring (result:<step>, evicted by HDEL) is read as it was.
local function stored_result(log_key, step, committed, window)
  if step > committed or step <= committed - window then
    return nil
  end
  return redis.call('HGET', log_key, result_field(step, window))
    or redis.call('HGET', log_key, 'result:' .. step_text(step))
end

-- The blob keys a log hash may refer to: one per result@<slot> field (its step from the session's
-- committed step and result window), per result:<step> field (a log written before the ring) and
-- per input:<step> field (a key that does not exist, for a result or an input stored inline, costs
-- a DEL or PEXPIRE nothing).
local function log_blobs(log_key, committed, window)
  local blobs = {}
  for _, field in ipairs(redis.call('HKEYS', log_key)) do
    local kind, sep, n = string.match(field, '^(%a+)([:@])(%-?%d+)$')
    if kind == 'result' and sep == '@' then
      local step = slot_step(tonumber(n), committed, window)
      if step >= 0 then
        blobs[#blobs + 1] = result_blob(log_key, step)
      end
    elseif kind == 'result' then
      blobs[#blobs + 1] = result_blob(log_key, n)
    elseif kind == 'input' then
      blobs[#blobs + 1] = record_blob(log_key, n)
    end
  end
  return blobs
end

-- What a reply entry carries for a stored result, with the result's size and the reply blob to
-- expire with the stream: a reference is copied to the reply's own blob (a reader then does not
-- depend on the session's result window). nil when the referenced blob is gone. The referenced
-- key is read from the stored value: a reference names a key the storing script had in KEYS
-- (commit.lua's result blob, fork.lua's copy), in the cell's hash tag and slot.
local function reply_value(stored, reply_blob)
  if not is_blob(stored) then
    return stored, #stored, nil
  end
  if redis.call('COPY', string.sub(stored, #BLOB_MARK + 1), reply_blob, 'REPLACE') == 0 then
    return nil
  end
  return BLOB_MARK .. reply_blob, redis.call('STRLEN', reply_blob), reply_blob
end

-- In place (2026-12-06): a reply whose reader reads a large result where the session's log keeps
-- it, with no copy of the bytes. A reader that reads so (the trainer's broker/client/replies.py)
-- keeps the key in_place_reader(its reply stream) standing while it runs; a commit to a stream
-- without that key copies as before. The entry's result is IN_PLACE_MARK, the result blob's key, a NUL and
-- the reply blob the reader would own; the marker (in_place_marker: a HASH named after the result
-- blob, the reply's TTL) holds that reply blob's name as a field while the reply is unread, and the
-- reader HDELs its own field with its read (a field, not the key: after a reset the same step's
-- blob, and so its marker, may belong to a later reply). A result blob that leaves the log
-- (hand_over_or: the window moves past it, a reset, a close) while its marker holds a reader goes
-- to that reader instead: RENAMEd to its reply blob, with what is left of the marker's TTL. No
-- reply is read without its bytes, and no blob is kept after its window and its reader are done.
local IN_PLACE_MARK = BLOB_MARK .. '\0'
local function in_place_marker(blob)
  return blob .. ':reader'
end
local function in_place_reader(reply_stream)
  return reply_stream .. ':in_place'
end
-- The TTL a reply stream and its blobs get for a result of `size` bytes (ReplyBounds): the caller's
-- text for the usual one, large_ttl_ms for a large result when it is the shorter.
local function reply_ttl(size, ttl_ms, large_bytes, large_ttl_ms)
  if size >= memo_number(large_bytes) and memo_number(large_ttl_ms) < memo_number(ttl_ms) then
    return large_ttl_ms
  end
  return ttl_ms
end
-- A blob leaving the log (`blob`: a result blob, or any key the log refers to): moved to the reader
-- of an unread in-place reply (true), else `otherwise(blob)` is done (false).
local function hand_over_or(blob, otherwise)
  local marker = in_place_marker(blob)
  -- One reader at most: a blob has one in-place reply (a re-publish copies), and a marker is
  -- deleted whenever its blob leaves the log, before the same name can be written again.
  local reader = redis.call('HKEYS', marker)[1]
  if reader then
    local ttl = redis.call('PTTL', marker)
    redis.call('DEL', marker)
    if ttl > 0 and redis.call('EXISTS', blob) == 1 then
      redis.call('RENAME', blob, reader)
      redis.call('PEXPIRE', reader, ttl)
      return true
    end
  end
  otherwise(blob)
  return false
end
local function delete_key(key)
  redis.call('DEL', key)
end

-- The fence: true when the session hash's owner and lease epoch (as stored, strings) are not the
-- caller's worker id and job epoch (ARGV strings). A fenced caller changes nothing.
local function fenced(owner, epoch, worker_id, job_epoch)
  return owner ~= worker_id or epoch ~= job_epoch
end

-- The session lookup of enqueue and control: the reply that stops the call (session_not_found,
-- session_closed, moved to another owner), or nil when the session is open and owned by the
-- owner the caller believes in. committed and context_length go back with the errors.
local function session_refusal(owner, closed, committed, context_length, believed_owner, session_id)
  if not owner then
    return {'error', 'session_not_found', 'session ' .. session_id .. ' does not exist', -1, 0}
  end
  if closed == '1' then
    return {'error', 'session_closed', 'session ' .. session_id .. ' is closed', committed, context_length}
  end
  if owner ~= believed_owner then
    return {'moved', owner}
  end
  return nil
end


-- Add an entry to a reply stream within its bounds (broker/redis/layouts.py ReplyBounds): the
-- stream is trimmed to the entries of this size its byte budget holds (128 bytes stand for the
-- entry's other fields), and a large result gives the stream the shorter TTL. `size` and `blob`
-- (optional): a result held in a reply blob (reply_value) counts its blob's size, and the blob
-- expires with the stream. The blobs of the oldest entries this one pushes past the budget are
-- deleted (trimming the stream would not free them): such an entry reads as a result that is gone.
-- Those reply blobs are named by the entries' references (the reply blobs the publishing scripts
-- had in KEYS), in the cell's hash tag and slot.
-- `streams` (optional, a batch's table): the stream's length is read once per batch and counted
-- on from there (an upper bound: trimming only shortens it, so a count under the budget needs no
-- read), and its TTL is set once, by flush_replies, to what the last entry added asks for, as a
-- PEXPIRE after each entry would leave it. Returns the entry's id.
-- While the stream has room for the entry, the XADD asks for no trim (MAXLEN ~ would trim nothing
-- then) and the entry leaves out `kind` when it is 'step' (ReplyEntry reads a missing one as 'step',
-- as every release since the field layouts were written down does): fewer arguments for the master
-- to convert and parse, and two bulk strings fewer for the reader. A stream at its budget, rare,
-- gets the whole entry and the trim.
local function add_reply(key, ttl_ms, stream_bytes, large_bytes, large_ttl_ms, kind, job_id, committed, result,
                         size, blob, streams)
  size = size or #result
  local maxlen = math.max(1, math.floor(memo_number(stream_bytes) / (size + 128)))
  local known = streams and streams[key]
  local length = known and known.length
  if not length or length + 1 > maxlen then
    length = redis.call('XLEN', key)
  end
  local over = length + 1 - maxlen
  if over > 0 then
    for _, entry in ipairs(redis.call('XRANGE', key, '-', '+', 'COUNT', over)) do
      local fields = entry[2]
      for i = 1, #fields - 1, 2 do
        local value = fields[i + 1]
        if fields[i] == 'result' and string.sub(value, 1, #IN_PLACE_MARK) == IN_PLACE_MARK then
          -- the bytes stay the log's; the reader's share (its marker field, a blob handed over) goes
          local cut = string.find(value, '\0', #IN_PLACE_MARK + 1, true)
          if cut then
            local reply_blob = string.sub(value, cut + 1)
            redis.call('HDEL', in_place_marker(string.sub(value, #IN_PLACE_MARK + 1, cut - 1)), reply_blob)
            redis.call('DEL', reply_blob)
          end
        elseif fields[i] == 'result' and is_blob(value) then
          redis.call('DEL', string.sub(value, #BLOB_MARK + 1))
        end
      end
    end
  end
  local id
  if over > 0 then
    id = redis.call('XADD', key, 'MAXLEN', '~', string.format('%d', maxlen), '*', 'kind', kind, 'job_id', job_id,
      'committed', committed, 'result', result)
  elseif kind == 'step' then
    id = redis.call('XADD', key, '*', 'job_id', job_id, 'committed', committed, 'result', result)
  else
    id = redis.call('XADD', key, '*', 'kind', kind, 'job_id', job_id, 'committed', committed, 'result', result)
  end
  local ttl = reply_ttl(size, ttl_ms, large_bytes, large_ttl_ms)  -- text passed on as it is
  if known then
    known.length, known.ttl = length + 1, ttl
  elseif streams then
    streams[key] = {length = length + 1, ttl = ttl}
  else
    redis.call('PEXPIRE', key, ttl)
  end
  if blob then
    redis.call('PEXPIRE', blob, ttl)
  end
  return id
end

-- The TTLs add_reply left to the end of a batch: one PEXPIRE per reply stream.
local function flush_replies(streams)
  for key, state in pairs(streams) do
    redis.call('PEXPIRE', key, state.ttl)
  end
end

-- The cell-wide hashes keyed by worker id (capacity, owned, pressure) and every session hash stay in
-- Redis's hashtable encoding from their first field on. Redis keeps a hash of at most
-- hash-max-listpack-entries fields (512 by default) as a listpack, which every lookup scans:
-- placement's lookups of a 333-worker pool cost a master ~0.5 ms per HMGET that way, ~25 us as a
-- hashtable; a session's ~21 fields, looked up 27 times per token step (enqueue.lua's and
-- commit.lua's HMGETs, a missing field scanning them all), cost its master 9% of the step
-- (docs/sizing.md). One field with a value longer than hash-max-listpack-value (64 bytes by
-- default) converts a hash for good, and keeps it converted when an RDB or a replica loads it. Its
-- name starts with a NUL byte, which no worker id or session field has; readers look fields up by
-- name (broker/redis/layouts.py SessionHash takes the fields it knows) and never list the worker
-- hashes (register.lua, create.lua and fork.lua write it).
local HASHTABLE_FIELD = '\0encoding'
local HASHTABLE_NOTE = 'keeps this hash in the hashtable encoding: a listpack would scan every field per lookup'
local function keep_hashtable(key)
  redis.call('HSETNX', key, HASHTABLE_FIELD, HASHTABLE_NOTE)
end

-- Per-worker capacity (create and failover): a worker's sessions over all its pools count against
-- its one capacity, and a pool's own cap (capacity field worker@pool, set where the engine splits
-- its capacity by model) bounds that pool's share. share_if_room takes the values as read (the
-- capacity hash's worker and worker@pool fields, the owned hash's worker field, the worker's
-- score in the pool; false or nil when absent) and returns the worker's session share
-- (owned / capacity) when it has room for one more session of this pool, else nil.
local function share_if_room(cap, owned, split, pool_load)
  cap = tonumber(cap or '0') or 0
  owned = tonumber(owned or '0') or 0
  if owned >= cap then
    return nil
  end
  if split and tonumber(pool_load) >= tonumber(split) then
    return nil
  end
  return owned / cap
end
local function share_with_room(capacity_key, owned_key, pool_key, wid, pool_load)
  return share_if_room(redis.call('HGET', capacity_key, wid), redis.call('HGET', owned_key, wid),
    redis.call('HGET', capacity_key, wid .. '@' .. pool_key), pool_load)
end

-- One command for many fields or members (HMGET, ZMSCORE), sent in slices: Lua's unpack holds
-- at most a few thousand values at once. The replies, in the order of `names`.
local MANY_SLICE = 1000
local function in_slices(names, call)
  local out = {}
  for first = 1, #names, MANY_SLICE do
    local part = call(first, math.min(#names, first + MANY_SLICE - 1))
    for i = 1, #part do
      out[#out + 1] = part[i]
    end
  end
  return out
end
local function hmget_many(key, fields)
  return in_slices(fields, function(first, last) return redis.call('HMGET', key, unpack(fields, first, last)) end)
end
local function zmscore_many(key, members)
  return in_slices(members, function(first, last) return redis.call('ZMSCORE', key, unpack(members, first, last)) end)
end

-- The packed step entry (broker/redis/inbox.py): enqueue.lua joins a step's small values into the
-- one field PACKED_FIELD, NUL-separated in the order of PACKED_PARTS (the model last: the one part
-- that could hold a NUL), for an owner whose worker hash has READS_FIELD = READS_PACKED.
-- unpacked_entry(fields): an entry's field list (as XRANGE gives it) with a packed field replaced
-- by its parts, each a field of its own (what an earlier release's worker or replay reads); the
-- list itself when nothing is packed, or when the packed field is malformed (the worker that reads
-- it dead-letters it as such).
local PACKED_FIELD, READS_FIELD, READS_PACKED = 'packed', 'inbox', 'packed'
local PACKED_PARTS = {'kind', 'step_id', 'contextual', 'gen', 'mode', 'enqueued_ms', 'attempt', 'model'}
local function unpacked_entry(fields)
  for i = 1, #fields - 1, 2 do
    if fields[i] == PACKED_FIELD then
      local value, parts, at = fields[i + 1], {}, 1
      for n = 1, #PACKED_PARTS - 1 do
        local cut = string.find(value, '\0', at, true)
        if not cut then
          return fields
        end
        parts[n], at = string.sub(value, at, cut - 1), cut + 1
      end
      parts[#PACKED_PARTS] = string.sub(value, at)
      local out = {}
      for j = 1, #fields - 1, 2 do
        if j ~= i then
          out[#out + 1], out[#out + 2] = fields[j], fields[j + 1]
        end
      end
      for n = 1, #PACKED_PARTS do
        out[#out + 1], out[#out + 2] = PACKED_PARTS[n], parts[n]
      end
      return out
    end
  end
  return fields
end

-- Whether the worker whose worker hash is `worker_key` reads packed entries (its READS_FIELD is
-- READS_PACKED; a hash that expired reads as no): one HGET per worker per script call.
local reads_packed_memo = {}
local function reads_packed(worker_key)
  local reads = reads_packed_memo[worker_key]
  if reads == nil then
    reads = redis.call('HGET', worker_key, READS_FIELD) == READS_PACKED
    reads_packed_memo[worker_key] = reads
  end
  return reads
end
