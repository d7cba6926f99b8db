-- Announce a weight update: add it to the cell's control stream (every worker of the model loads
-- it) and raise the model's announced version in the same script, so the version that
-- max_staleness and admission compare against (docs/async_rl.md) never lags the stream. The
-- announced version only goes up: a late or repeated announcement of an older one leaves it.
-- KEYS: 1 control stream, 2 announced hash (model -> highest announced version)
-- ARGV: 1 model, 2 version, 3 stream maxlen (approximate), 4.. the entry's field/value pairs
--       (broker/ops/weights.py WeightUpdate.fields)
-- Returns the control entry's id
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
local current = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') or 0
if tonumber(ARGV[2]) > current then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
return id
