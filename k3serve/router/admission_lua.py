"""The Lua scripts of admission.py (each runs atomically in Redis; the rule they implement is documented there).

Key roles and return values are listed above each script; ``now`` is Redis's own clock (ms).
"""

TRY, WAIT, REFUSE = 0, 1, 2  # RESERVE's modes
TICKET_KEYS = ("tix", "tixexp", "tixtok", "tixat", "tixfree")  # the ticket keys of one (cluster, class), in order

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

# Places in line held for refused requests (admission.py, "Tickets"). T: the five ticket keys of one
# (cluster, class): tix (ZSET id -> place, from the queue's arrival counter), exp (ZSET id -> expiry ms),
# tok (HASH id -> tokens), at (HASH id -> "issued ms:hinted ms"), free (HASH id -> first ms its place was seen free).
# A: {sum, count, budget, maxc, q, qtok} of the budget. Needs LUA_COMMON (now, fits is defined here).
LUA_TICKETS = """
local function fits_in(A, t, s, c) return c == 0 or (s + t <= A.budget and c < A.maxc) end
local function purge_tickets(T)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', T.exp, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    for _, k in ipairs({T.exp, T.tix}) do redis.call('ZREM', k, unpack(dead)) end
    for _, k in ipairs({T.tok, T.at, T.free}) do redis.call('HDEL', k, unpack(dead)) end
  end
end
local function drop_ticket(T, id)
  redis.call('ZREM', T.tix, id)
  redis.call('ZREM', T.exp, id)
  for _, k in ipairs({T.tok, T.at, T.free}) do redis.call('HDEL', k, id) end
end
-- the ticket keys live no longer than their last ticket (keys of unadmitted requests expire fast)
local function keep_keys(T, until_ms)
  local ttl = until_ms - now + 1000
  for _, k in ipairs({T.tix, T.exp, T.tok, T.at, T.free}) do
    local cur = redis.call('PTTL', k)
    if cur ~= -2 and cur < ttl then redis.call('PEXPIRE', k, ttl) end
  end
end
-- ... and exactly as long as the latest ticket (after a hint shortened one from its unhinted life)
local function fit_keys(T)
  local last = redis.call('ZRANGE', T.exp, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local ttl = math.max(tonumber(last[2]) - now, 0) + 1000
  for _, k in ipairs({T.tix, T.exp, T.tok, T.at, T.free}) do
    if redis.call('EXISTS', k) == 1 then redis.call('PEXPIRE', k, ttl) end
  end
end
local function extend_ticket(T, id, until_ms)
  if tonumber(redis.call('ZSCORE', T.exp, id) or '0') < until_ms then
    redis.call('ZADD', T.exp, until_ms, id)
    keep_keys(T, until_ms)
  end
end
local function issue_ticket(T, id, place, tokens, until_ms)
  redis.call('ZADD', T.tix, place, id)
  redis.call('ZADD', T.exp, until_ms, id)
  redis.call('HSET', T.tok, id, tokens)
  redis.call('HSET', T.at, id, now .. ':' .. now)
  keep_keys(T, until_ms)
end
-- (tokens, count) of the line ahead of `place` (nil: the end of the line): queue entries (but `self`) and held
-- places with a smaller place; counting stops at `cap` of each, beyond which nothing fits anyway
local function line_ahead(A, T, place, self, cap)
  local hi = place and ('(' .. place) or '+inf'
  local s, c = 0, 0
  for _, z in ipairs({{T.tix, T.tok}, {A.q, A.qtok}}) do
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', z[1], '-inf', hi, 'LIMIT', 0, cap)) do
      if id ~= self then s, c = s + tonumber(redis.call('HGET', z[2], id) or '0'), c + 1 end
    end
  end
  return s, c
end
-- The admission rule for a request of t tokens at `place` (nil: a newcomer) whose own queue entry is `self`:
-- it fits with everything ahead of it in line (waiters and held places) counted as taken. So nobody passes a
-- request ahead unless that one still fits too: an oversized head (it runs alone) holds up everyone behind it.
local function admissible(A, T, place, self, t)
  local s, c = line_ahead(A, T, place, self, A.maxc)
  return fits_in(A, t, A.sum + s, A.count + c)
end
-- Stamp the first moment each held place is free (its holder would be admitted now): the hint's accuracy.
local function mark_free(A, T)
  local first = redis.call('ZRANGE', T.tix, 0, A.maxc, 'WITHSCORES')
  for i = 1, #first, 2 do
    local id = first[i]
    if redis.call('HEXISTS', T.free, id) == 0 then
      local t = tonumber(redis.call('HGET', T.tok, id) or '0')
      if admissible(A, T, tonumber(first[i + 1]), '', t) then
        redis.call('HSET', T.free, id, now)
        redis.call('PEXPIRE', T.free, math.max(redis.call('PTTL', T.tix), 1000))
      end
    end
  end
end
"""

# KEYS: lease, tok, q, qlease, qtok, seq, end, tix, tixexp, tixtok, tixat, tixfree, turn, alive ('' = no guard),
#       recover.
# ARGV: request_id, tokens, budget, max_concurrent, lease_ms, mode (0 try, 1 wait, 2 refuse: only a place in line),
#       queue_limit, qlease_ms, expected duration ms (0: none), alive ttl ms, recovery grace ms,
#       presented ticket ('' none), id of a new ticket ('' never issue one), unhinted ticket life ms, ticket limit.
# Returns {status, inflight tokens, inflight count, queue length, lease expiry ms, recovering (0/1),
#          ticket held after the call ('' none), presented ticket (0 none, 1 honoured, 2 unknown/expired),
#          and for an honoured ticket that got in: issued ms, hinted ms, first moment its place was free ms}
# status: 1 reserved, 0 not reserved (mode 0 / 2, or a ticket whose place is not free yet), 2 queued / still
# waiting, 3 queue full.
RESERVE = LUA_COMMON + LUA_TICKETS + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local budget, maxc, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, qlimit, qlease_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local T = {tix = KEYS[8], exp = KEYS[9], tok = KEYS[10], at = KEYS[11], free = KEYS[12]}
purge(KEYS[1], KEYS[2], nil, KEYS[7])
purge(KEYS[4], KEYS[5], KEYS[3])
purge_tickets(T)
local rec = recovering(KEYS[14], KEYS[15], ARGV[10], ARGV[11])
local sum, count = inflight(KEYS[1], KEYS[2])
local A = {sum = sum, count = count, budget = budget, maxc = maxc, q = KEYS[3], qtok = KEYS[5]}
if not rec then mark_free(A, T) end
if redis.call('ZSCORE', KEYS[1], rid) then
  -- a retried call (e.g. the reply was lost): the reservation exists, renew it
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  return {1, sum, count, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0, '', 0, 0, 0, 0}
end
-- this request's place in line: its ticket's, its queue entry's, or (nil) the end of the line
local tk, tstate, place = ARGV[12], 0, nil
if tk ~= '' then
  local p = redis.call('ZSCORE', T.tix, tk)
  if p then place, tstate = tonumber(p), 1 else tk, tstate = '', 2 end
end
local qs = redis.call('ZSCORE', KEYS[3], rid)
if qs then place = tonumber(qs) end
-- while Redis recovers from a state loss, nothing new gets in: holders are still putting their leases back
local ok = mode ~= 2 and (not rec) and admissible(A, T, place, rid, tokens)
if ok then
  -- the budget's turnover: the mean interval between admissions while the line is not empty (each one took a
  -- place that had just come free), the measured pace at which places in the line come free (retry hints). A
  -- ticket holder that came back after its place came free counts from that moment: the service's pace, not
  -- the client's lateness.
  local line = place ~= nil or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', T.tix) > 0
  local at = now
  if tk ~= '' then at = math.min(now, tonumber(redis.call('HGET', T.free, tk) or now)) end
  local last = tonumber(redis.call('HGET', KEYS[13], 'last') or '0')
  -- (a place that was free before the last admission is not the next one in the budget's sequence: skipped)
  if line and last > 0 and at > last and now - last < 30000 then
    local dt = at - last
    local ewma = tonumber(redis.call('HGET', KEYS[13], 'ewma') or '-1')
    ewma = ewma < 0 and dt or (0.8 * ewma + 0.2 * dt)
    redis.call('HSET', KEYS[13], 'ewma', math.floor(ewma))
  end
  redis.call('HSET', KEYS[13], 'last', math.max(at, last))
  redis.call('PEXPIRE', KEYS[13], 3600000)
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  redis.call('HSET', KEYS[2], rid, ARGV[2])
  redis.call('ZREM', KEYS[3], rid)
  redis.call('ZREM', KEYS[4], rid)
  redis.call('HDEL', KEYS[5], rid)
  -- the expected end, when the caller gave a duration (none: Admission.retry_after assumes max_wait_s)
  if tonumber(ARGV[9]) > 0 then redis.call('HSET', KEYS[7], rid, now + tonumber(ARGV[9])) end
  local issued, hinted, free = 0, 0, 0
  if tk ~= '' then
    local at = redis.call('HGET', T.at, tk) or (now .. ':' .. now)
    local sep = string.find(at, ':', 1, true)
    issued, hinted = tonumber(string.sub(at, 1, sep - 1)), tonumber(string.sub(at, sep + 1))
    free = tonumber(redis.call('HGET', T.free, tk) or now)
    drop_ticket(T, tk)
  end
  return {1, sum + tokens, count + 1, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0, '', tstate, issued, hinted,
          free}
end
local r = rec and 1 or 0
local qlen = redis.call('ZCARD', KEYS[3])
-- refused: the request keeps (or gets) a place in line, held for it until a bounded time after its hinted moment
local function refuse(status)
  local out = ''
  if tk ~= '' then
    extend_ticket(T, tk, now + tonumber(ARGV[14]))
    out = tk
  elseif ARGV[13] ~= '' and redis.call('ZCARD', T.tix) < tonumber(ARGV[15]) then
    local seq = place  -- a waiter keeps its place in the queue as its ticket's
    if qs then
      redis.call('ZREM', KEYS[3], rid)
      redis.call('ZREM', KEYS[4], rid)
      redis.call('HDEL', KEYS[5], rid)
    else
      seq = redis.call('INCR', KEYS[6])
    end
    issue_ticket(T, ARGV[13], seq, tokens, now + tonumber(ARGV[14]))
    out = ARGV[13]
  end
  return {status, sum, count, redis.call('ZCARD', KEYS[3]), 0, r, out, tstate, 0, 0, 0}
end
-- a ticket holder back before its place is free does not wait (a waiting stream holds a router thread, and early
-- returners would fill them while a holder whose place is free is turned away): refused at once, same place
if mode ~= 1 or tk ~= '' then return refuse(0) end
if qs then
  redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
  return {2, sum, count, qlen, 0, r, '', tstate, 0, 0, 0}
end
if qlen >= qlimit then return refuse(3) end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), rid)
redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
redis.call('HSET', KEYS[5], rid, ARGV[2])
return {2, sum, count, qlen + 1, 0, r, '', tstate, 0, 0, 0}
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

# KEYS: lease, tok, q, qlease, qtok, end, tix, tixexp, tixtok, tixat, tixfree. ARGV: budget, max_concurrent.
# Returns {inflight tokens, inflight count, queue length, held places}.
STATS = LUA_COMMON + LUA_TICKETS + """
local T = {tix = KEYS[7], exp = KEYS[8], tok = KEYS[9], at = KEYS[10], free = KEYS[11]}
purge(KEYS[1], KEYS[2], nil, KEYS[6])
purge(KEYS[4], KEYS[5], KEYS[3])
purge_tickets(T)
local sum, count = inflight(KEYS[1], KEYS[2])
if tonumber(ARGV[2]) > 0 then
  mark_free({sum = sum, count = count, budget = tonumber(ARGV[1]), maxc = tonumber(ARGV[2]), q = KEYS[3],
             qtok = KEYS[5]}, T)
end
return {sum, count, redis.call('ZCARD', KEYS[3]), redis.call('ZCARD', T.tix)}
"""

# KEYS: lease, tok, q, qtok, end, tix, tixtok, turn. ARGV: ticket id ('' = the end of the line). Returns {now ms,
# waiters ahead, their tokens, turnover ms (-1: not measured), last admission ms (-1: none), tokens_1, end_1,
# tokens_2, ...} over the live leases (end -1: none published). Waiters ahead: queue entries and held places before
# the ticket's place (all of them for '').
HOLDERS = LUA_COMMON + """
local place = nil
if ARGV[1] ~= '' then place = redis.call('ZSCORE', KEYS[6], ARGV[1]) end
local hi = place and ('(' .. place) or '+inf'
local out = {now, 0, 0, tonumber(redis.call('HGET', KEYS[8], 'ewma') or '-1'),
             tonumber(redis.call('HGET', KEYS[8], 'last') or '-1')}
for _, z in ipairs({{KEYS[3], KEYS[4]}, {KEYS[6], KEYS[7]}}) do
  local ids = redis.call('ZRANGEBYSCORE', z[1], '-inf', hi)
  out[2] = out[2] + #ids
  for _, id in ipairs(ids) do out[3] = out[3] + tonumber(redis.call('HGET', z[2], id) or '0') end
end
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  table.insert(out, tonumber(redis.call('HGET', KEYS[2], rid) or '0'))
  table.insert(out, tonumber(redis.call('HGET', KEYS[5], rid) or '-1'))
end
return out
"""

# KEYS: tix, tixexp, tixtok, tixat, tixfree. ARGV: ticket id, hint ms, grace ms. The hint handed out with a
# ticket: its place is held until grace after the hinted moment. Returns the hinted moment (ms), 0: no such ticket.
SET_HINT = LUA_COMMON + LUA_TICKETS + """
local T = {tix = KEYS[1], exp = KEYS[2], tok = KEYS[3], at = KEYS[4], free = KEYS[5]}
if not redis.call('ZSCORE', T.tix, ARGV[1]) then return 0 end
local at = now + tonumber(ARGV[2])
redis.call('ZADD', T.exp, at + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', T.at, ARGV[1], now .. ':' .. at)
fit_keys(T)
return at
"""

# KEYS: tix, tixexp, tixtok, tixat, tixfree. ARGV: ticket id. A ticket given up (its holder was cancelled or went
# to another budget): its place is free at once. Returns 1 if it existed.
DROP_TICKET = LUA_COMMON + LUA_TICKETS + """
local existed = redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0
drop_ticket({tix = KEYS[1], exp = KEYS[2], tok = KEYS[3], at = KEYS[4], free = KEYS[5]}, ARGV[1])
return existed
"""
