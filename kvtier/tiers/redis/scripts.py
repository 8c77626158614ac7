"""The Lua scripts that keep the Redis tier's byte budget: its index keys
(``{<key_prefix>idx}:lru``, ``:size``, ``:used``, ``:seq``, one hash tag, so
that in a cluster they live in one slot and each script stays atomic)
admitted, touched and forgotten in one round trip each."""

# KEYS: lru, size, seq, used. ARGV: capacity, then name, bytes per object.
# Returns {status per admitted object (1 new, 0 already indexed), victims,
# used, count}; it stops at an object larger than the whole capacity.
ADMIT = """
local cap = tonumber(ARGV[1])
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
local status, victims = {}, {}
for i = 2, #ARGV, 2 do
  local m, size = ARGV[i], tonumber(ARGV[i + 1])
  local seq = redis.call('INCR', KEYS[3])
  if redis.call('ZSCORE', KEYS[1], m) then
    redis.call('ZADD', KEYS[1], seq, m)
    status[#status + 1] = 0
  else
    if size > cap then break end
    while used + size > cap do
      local v = redis.call('ZPOPMIN', KEYS[1])
      if #v == 0 then break end
      used = used - tonumber(redis.call('HGET', KEYS[2], v[1]) or '0')
      redis.call('HDEL', KEYS[2], v[1])
      victims[#victims + 1] = v[1]
    end
    redis.call('ZADD', KEYS[1], seq, m)
    redis.call('HSET', KEYS[2], m, size)
    used = used + size
    status[#status + 1] = 1
  end
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[4], used)
return {status, victims, used, redis.call('ZCARD', KEYS[1])}
"""

# KEYS: lru, seq. ARGV: names read. Makes them the most recent, in order.
TOUCH = """
for i = 1, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[i])
end
return 0
"""

# KEYS: lru, size, used. ARGV: names deleted. Returns {used, count}.
FORGET = """
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    used = used - tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[3], used)
return {used, redis.call('ZCARD', KEYS[1])}
"""
