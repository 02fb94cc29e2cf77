"""The Lua scripts of admission.py: each runs atomically in Redis, on Redis's own clock (``now``, ms), so budgets
hold across router replicas. The rule they implement and the key layout are documented in admission.py."""

TRY, WAIT = 0, 1  # RESERVE's modes

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Drop the members of zset z whose expiry <= now from z, hash h and (if given) hash h2 or zset z2; in chunks,
-- because unpack() has a stack limit.
local function purge(z, h, h2, z2)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    redis.call('ZREM', z, unpack(dead))
    redis.call('HDEL', h, unpack(dead))
    if h2 then redis.call('HDEL', h2, unpack(dead)) end
    if z2 then redis.call('ZREM', z2, unpack(dead)) end
  end
end
-- The state-loss guard (alive key, recover key, alive ttl ms, grace ms; alive = '' disables it): true while Redis
-- is recovering from a loss of its state.
local function recovering(alive, recover, alive_ms, grace_ms)
  if alive == '' then return false end
  if redis.call('EXISTS', alive) == 0 then redis.call('SET', recover, '1', 'PX', grace_ms) end
  redis.call('SET', alive, '1', 'PX', alive_ms)
  return redis.call('EXISTS', recover) == 1
end
"""

# The scripts of one (cluster, class) take its keys in Admission.keys' order.
_CLASS = _COMMON + """
local lease, tok, ends, rel, q, qlease, qtok, seq = unpack(KEYS)
"""

# KEYS: the class's, then alive ('' = no guard), recover.
# ARGV: request_id, tokens, budget, max_concurrent, lease_ms, mode (0 try, 1 wait), queue_limit, qlease_ms,
#       expected duration ms (0: none), alive ttl ms, recovery grace ms.
# Returns {status, lease expiry ms, queue length, recovering 0/1}; status 1 reserved, 0 not (mode 0), 2 queued /
# still waiting, 3 queue full.
RESERVE = _CLASS + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local budget, maxc, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, qlimit, qlease_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
purge(lease, tok, ends)
purge(qlease, qtok, nil, q)
local rec = recovering(KEYS[9], KEYS[10], ARGV[10], ARGV[11])
local r = rec and 1 or 0
if redis.call('ZSCORE', lease, rid) then  -- a retried call (the reply was lost): renew the reservation
  redis.call('ZADD', lease, now + lease_ms, rid)
  return {1, now + lease_ms, redis.call('ZCARD', q), 0}
end
-- in flight plus the live waiters ahead of this request (all of them for a newcomer), counted as taken
local s, c = 0, redis.call('ZCARD', lease)
for _, v in ipairs(redis.call('HVALS', tok)) do s = s + tonumber(v) end
local place = redis.call('ZSCORE', q, rid)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', q, '-inf', place and ('(' .. place) or '+inf', 'LIMIT', 0, maxc + 1)) do
  s, c = s + tonumber(redis.call('HGET', qtok, id) or '0'), c + 1
end
-- while Redis recovers from a state loss nothing new gets in: holders are still putting their leases back
if not rec and (c == 0 or (s + tokens <= budget and c < maxc)) then
  redis.call('ZADD', lease, now + lease_ms, rid)
  redis.call('HSET', tok, rid, tokens)
  redis.call('ZREM', q, rid)
  redis.call('ZREM', qlease, rid)
  redis.call('HDEL', qtok, rid)
  if tonumber(ARGV[9]) > 0 then redis.call('HSET', ends, rid, now + tonumber(ARGV[9])) end
  return {1, now + lease_ms, redis.call('ZCARD', q), 0}
end
local qlen = redis.call('ZCARD', q)
if mode == 0 then return {0, 0, qlen, r} end
if place then
  redis.call('ZADD', qlease, now + qlease_ms, rid)
  return {2, 0, qlen, r}
end
if qlen >= qlimit then return {3, 0, qlen, r} end
redis.call('ZADD', q, redis.call('INCR', seq), rid)
redis.call('ZADD', qlease, now + qlease_ms, rid)
redis.call('HSET', qtok, rid, tokens)
return {2, 0, qlen + 1, r}
"""

# ARGV: request_id, lease_ms, tokens, expected remaining ms. Returns {new expiry ms, 1 if the lease was gone and
# has been put back else 0}: a running request's tokens are in use whatever Redis remembers. {0, 0} for a lease
# released since the caller looked (rel): a renewal racing a release never resurrects it.
REASSERT = _CLASS + """
purge(lease, tok, ends)
local rid, lease_ms = ARGV[1], tonumber(ARGV[2])
local lost = 0
if not redis.call('ZSCORE', lease, rid) then
  if tonumber(redis.call('ZSCORE', rel, rid) or '0') > now then return {0, 0} end
  lost = 1
  redis.call('HSET', tok, rid, ARGV[3])
end
redis.call('ZADD', lease, now + lease_ms, rid)
redis.call('HSET', ends, rid, now + tonumber(ARGV[4]))
return {now + lease_ms, lost}
"""

# ARGV: request_id, lease_ms. Returns 1 if this call released the lease. The release is remembered for a lease's
# life (rel), so that a renewer that read the lease before it cannot put it back.
RELEASE = _CLASS + """
local removed = redis.call('ZREM', lease, ARGV[1])
redis.call('HDEL', tok, ARGV[1])
redis.call('HDEL', ends, ARGV[1])
redis.call('ZREMRANGEBYSCORE', rel, '-inf', now)
redis.call('ZADD', rel, now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', rel, tonumber(ARGV[2]))
return removed
"""

# KEYS: alive, recover. ARGV: alive ttl ms, grace ms. The renewer's beat: returns 1 while recovering.
TOUCH = _COMMON + """
return recovering(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) and 1 or 0
"""

# Returns {now ms, waiters, their tokens, tokens_1, end_1, tokens_2, ...} over the live leases (end -1: none
# published): the class's load (Admission.stats) and the retry hint's input.
LOAD = _CLASS + """
purge(lease, tok, ends)
purge(qlease, qtok, nil, q)
local qtokens = 0
for _, v in ipairs(redis.call('HVALS', qtok)) do qtokens = qtokens + tonumber(v) end
local out = {now, redis.call('ZCARD', q), qtokens}
for _, rid in ipairs(redis.call('ZRANGE', lease, 0, -1)) do
  table.insert(out, tonumber(redis.call('HGET', tok, rid) or '0'))
  table.insert(out, tonumber(redis.call('HGET', ends, rid) or '-1'))
end
return out
"""
