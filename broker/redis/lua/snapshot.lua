-- Store a snapshot of a session's engine context (workers/rebuild.py) in its log hash, so that
-- a new owner restores it and replays only the steps after it. Fenced like a commit, and written
-- only for a committed step of the session's current gen: a reset (gen + 1, log dropped) or a
-- close (log expiring) is never undone by a late write. The log hash holds it, so it goes where
-- the step log goes: dropped on reset, expired on close.
-- Uses: prelude.lua (fenced)
-- KEYS: 1 session hash, 2 log hash
-- ARGV: 1 worker id, 2 job epoch, 3 step_id the snapshot follows, 4 the job's gen, 5 snapshot
-- Fields (broker/redis/layouts.py): reads session owner, epoch, committed_step_id, gen, closed;
--       writes log snapshot (LOG_SNAPSHOT_FIELD)
-- Returns 1 when written, 0 when refused (fenced, stale gen, closed, step not committed)
local session_key = KEYS[1]
local log_key = KEYS[2]
local worker_id = ARGV[1]
local job_epoch = ARGV[2]
local step = tonumber(ARGV[3])
local job_gen = ARGV[4]
local snapshot = ARGV[5]
local s = redis.call('HMGET', session_key, 'owner', 'epoch', 'committed_step_id', 'gen', 'closed')
if fenced(s[1], s[2], worker_id, job_epoch) then
  return 0
end
if s[5] == '1' or s[4] ~= job_gen or tonumber(s[3] or '-1') < step then
  return 0
end
if redis.call('EXISTS', log_key) == 0 then  -- no committed record: nothing to snapshot against
  return 0
end
redis.call('HSET', log_key, 'snapshot', snapshot)
return 1
