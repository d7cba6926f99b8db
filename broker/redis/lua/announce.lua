-- Announce a weight update: add it to the cell's control stream (every worker of the model loads
-- it) and raise the model's announced version in the same script, so the version that
-- max_staleness and admission compare against (docs/async_rl.md) never lags the stream. The
-- announced version only goes up: a late or repeated announcement of an older one leaves it.
-- KEYS: 1 control stream, 2 announced hash (model -> highest announced version)
-- ARGV: 1 model, 2 version, 3 stream maxlen (approximate), 4.. the entry's field/value pairs
--       (broker/ops/weights.py WeightUpdate.fields)
-- Returns the control entry's id
local control_key = KEYS[1]
local announced_key = KEYS[2]
local model = ARGV[1]
local version = ARGV[2]
local maxlen = ARGV[3]
local first_field = 4
local id = redis.call('XADD', control_key, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, first_field))
local current = tonumber(redis.call('HGET', announced_key, model) or '0') or 0
if tonumber(version) > current then
  redis.call('HSET', announced_key, model, version)
end
return id
