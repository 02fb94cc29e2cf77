"""The Lua scripts of admission.py (each runs atomically in Redis; the rule they implement is documented there).

Key roles and return values are listed above each script; ``now`` is Redis's own clock (ms).
"""

LUA_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Drop the members of lease zset z whose expiry <= now, and the same members from hash h, and from z2 (a zset)
-- or h2 (a hash) if given. In chunks, because unpack() has a stack limit.
local function purge(z, h, z2, h2)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    redis.call('ZREM', z, unpack(dead))
    redis.call('HDEL', h, unpack(dead))
    if z2 then redis.call('ZREM', z2, unpack(dead)) end
    if h2 then redis.call('HDEL', h2, unpack(dead)) end
  end
end
-- The state-loss guard (alive key, recover key, alive ttl ms, grace ms; alive = '' disables it): true while
-- Redis is recovering from a loss of its state.
local function recovering(alive, recover, alive_ms, grace_ms)
  if alive == '' then return false end
  if redis.call('EXISTS', alive) == 0 then
    redis.call('SET', recover, '1', 'PX', grace_ms)
  end
  redis.call('SET', alive, '1', 'PX', alive_ms)
  return redis.call('EXISTS', recover) == 1
end
local function inflight(lease, tok)
  local sum = 0
  for _, v in ipairs(redis.call('HVALS', tok)) do sum = sum + tonumber(v) end
  return sum, redis.call('ZCARD', lease)
end
"""

# KEYS: lease, tok, q, qlease, qtok, seq, end, alive ('' = no guard), recover.
# ARGV: request_id, tokens, budget, max_concurrent, lease_ms, mode (0 try, 1 wait), queue_limit, qlease_ms,
#       expected duration ms (0: none), alive ttl ms, recovery grace ms.
# Returns {status, inflight tokens, inflight count, queue length, lease expiry ms, recovering (0/1)}
# status: 1 reserved, 0 not reserved (mode 0), 2 queued / still waiting, 3 queue full.
RESERVE = LUA_COMMON + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local budget, maxc, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, qlimit, qlease_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
purge(KEYS[1], KEYS[2], nil, KEYS[7])
purge(KEYS[4], KEYS[5], KEYS[3])
local rec = recovering(KEYS[8], KEYS[9], ARGV[10], ARGV[11])
local sum, count = inflight(KEYS[1], KEYS[2])
if redis.call('ZSCORE', KEYS[1], rid) then
  -- a retried call (e.g. the reply was lost): the reservation exists, renew it
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  return {1, sum, count, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0}
end
local function fits(t, s, c) return c == 0 or (s + t <= budget and c < maxc) end
-- while Redis recovers from a state loss, nothing new gets in: holders are still putting their leases back
local ok = (not rec) and fits(tokens, sum, count)
if ok then
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #head > 0 and head[1] ~= rid then
    local ht = tonumber(redis.call('HGET', KEYS[5], head[1]) or '0')
    ok = fits(ht, sum + tokens, count + 1)
  end
end
if ok then
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  redis.call('HSET', KEYS[2], rid, ARGV[2])
  redis.call('ZREM', KEYS[3], rid)
  redis.call('ZREM', KEYS[4], rid)
  redis.call('HDEL', KEYS[5], rid)
  -- the expected end, when the caller gave a duration (none: Admission.retry_after assumes max_wait_s)
  if tonumber(ARGV[9]) > 0 then redis.call('HSET', KEYS[7], rid, now + tonumber(ARGV[9])) end
  return {1, sum + tokens, count + 1, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0}
end
local r = rec and 1 or 0
local qlen = redis.call('ZCARD', KEYS[3])
if mode == 0 then return {0, sum, count, qlen, 0, r} end
if redis.call('ZSCORE', KEYS[4], rid) then
  redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
  return {2, sum, count, qlen, 0, r}
end
if qlen >= qlimit then return {3, sum, count, qlen, 0, r} end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), rid)
redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
redis.call('HSET', KEYS[5], rid, ARGV[2])
return {2, sum, count, qlen + 1, 0, r}
"""

# KEYS: lease, tok. ARGV: request_id, lease_ms. Returns the new expiry (ms), or 0 when the lease is gone or expired
# (renew never revives an expired lease: its tokens may already be promised to someone else; see REASSERT).
RENEW = LUA_COMMON + """
purge(KEYS[1], KEYS[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return now + tonumber(ARGV[2])
"""

# KEYS: lease, tok, end. ARGV: request_id, lease_ms, tokens, expected remaining ms.
# Returns {new expiry ms, 1 if the lease was gone and has been put back else 0}. For a request that is running:
# its tokens are in use whether or not Redis remembers them, so a lost lease is put back (and counted), not dropped.
REASSERT = LUA_COMMON + """
purge(KEYS[1], KEYS[2], nil, KEYS[3])
local lost = 0
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  lost = 1
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], now + tonumber(ARGV[4]))
return {now + tonumber(ARGV[2]), lost}
"""

# KEYS: alive, recover. ARGV: alive ttl ms, grace ms. The renewer's beat: returns 1 while recovering.
TOUCH = LUA_COMMON + """
return recovering(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) and 1 or 0
"""

# KEYS: lease, tok, q, qlease, qtok, end. Returns {inflight tokens, inflight count, queue length}.
STATS = LUA_COMMON + """
purge(KEYS[1], KEYS[2], nil, KEYS[6])
purge(KEYS[4], KEYS[5], KEYS[3])
local sum, count = inflight(KEYS[1], KEYS[2])
return {sum, count, redis.call('ZCARD', KEYS[3])}
"""

# KEYS: lease, tok, q, qtok, end. Returns {now ms, queue length, queued tokens, tokens_1, end_1, tokens_2, ...}
# over the live leases (end -1: none published).
HOLDERS = LUA_COMMON + """
local out = {now, redis.call('ZCARD', KEYS[3]), 0}
for _, v in ipairs(redis.call('HVALS', KEYS[4])) do out[3] = out[3] + tonumber(v) end
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  table.insert(out, tonumber(redis.call('HGET', KEYS[2], rid) or '0'))
  table.insert(out, tonumber(redis.call('HGET', KEYS[5], rid) or '-1'))
end
return out
"""
