-- prelude.lua: the idioms several scripts share, written once. Redis has no include, so
-- broker.redis.scripts.lua_source prepends this file to every script whose header says
-- "Uses: prelude.lua"; each script stays one file.

-- Redis server time in ms (TIME answers seconds and microseconds): one clock for every worker.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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

-- The blob keys a log hash may refer to: one per result:<step> field and one per input:<step>
-- field (a key that does not exist, for a result or an input stored inline, costs a DEL or
-- PEXPIRE nothing).
local function log_blobs(log_key)
  local blobs = {}
  for _, field in ipairs(redis.call('HKEYS', log_key)) do
    local kind, step = string.match(field, '^(%a+):(%-?%d+)$')
    if kind == 'result' then
      blobs[#blobs + 1] = result_blob(log_key, step)
    elseif kind == 'input' then
      blobs[#blobs + 1] = record_blob(log_key, step)
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
local function add_reply(key, ttl_ms, stream_bytes, large_bytes, large_ttl_ms, kind, job_id, committed, result,
                         size, blob)
  size = size or #result
  local maxlen = math.max(1, math.floor(tonumber(stream_bytes) / (size + 128)))
  local over = redis.call('XLEN', key) + 1 - maxlen
  if over > 0 then
    for _, entry in ipairs(redis.call('XRANGE', key, '-', '+', 'COUNT', over)) do
      local fields = entry[2]
      for i = 1, #fields - 1, 2 do
        if fields[i] == 'result' and is_blob(fields[i + 1]) then
          redis.call('DEL', string.sub(fields[i + 1], #BLOB_MARK + 1))
        end
      end
    end
  end
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'kind', kind, 'job_id', job_id, 'committed', committed,
    'result', result)
  local ttl = tonumber(ttl_ms)
  if size >= tonumber(large_bytes) then
    ttl = math.min(ttl, tonumber(large_ttl_ms))
  end
  redis.call('PEXPIRE', key, ttl)
  if blob then
    redis.call('PEXPIRE', blob, ttl)
  end
end

-- Per-worker capacity (create and failover): a worker's sessions over all its pools count against
-- its one capacity, and a pool's own cap (capacity field worker@pool, set where the engine splits
-- its capacity by model) bounds that pool's share. Returns the worker's session share
-- (owned / capacity) when it has room for one more session of this pool, else nil.
local function share_with_room(capacity_key, owned_key, pool_key, wid, pool_load)
  local cap = tonumber(redis.call('HGET', capacity_key, wid) or '0') or 0
  local owned = tonumber(redis.call('HGET', owned_key, wid) or '0') or 0
  if owned >= cap then
    return nil
  end
  local split = redis.call('HGET', capacity_key, wid .. '@' .. pool_key)
  if split and tonumber(pool_load) >= tonumber(split) then
    return nil
  end
  return owned / cap
end
