"""The Lua scripts of admission.py (each runs atomically in Redis; the rule they implement is documented there).

Key roles and return values are listed above each script; ``now`` is Redis's own clock (ms).
"""

from k3serve.router.admission_line_lua import LUA_LINE, TICKET_KEYS  # noqa: F401 (TICKET_KEYS re-exported)

TRY, WAIT, REFUSE = 0, 1, 2  # RESERVE's modes

LUA_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Drop the members of lease zset z whose expiry <= now, and the same members from hash h, and from z2 (a zset)
-- or h2, h3 (hashes) if given. In chunks, because unpack() has a stack limit.
local function purge(z, h, z2, h2, h3)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    redis.call('ZREM', z, unpack(dead))
    redis.call('HDEL', h, unpack(dead))
    if z2 then redis.call('ZREM', z2, unpack(dead)) end
    if h2 then redis.call('HDEL', h2, unpack(dead)) end
    if h3 and h3 ~= '' then redis.call('HDEL', h3, unpack(dead)) end
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
-- Whether the host is saturated: every co-located budget of the class given from KEYS[first] on, as (lease, q,
-- tix) triples, has a line (queue entries or held places) or all its maxc rooms taken (maxc 0: only a line counts).
-- True when none is given (a cluster alone on its host). (Stricter tests, rooms all taken alone or some taken and
-- a line, held too rarely outside a burst's first seconds: the pace learned was those slow first holds'.)
local function host_saturated(first, maxc)
  for i = first, #KEYS, 3 do
    if redis.call('ZCARD', KEYS[i + 1]) + redis.call('ZCARD', KEYS[i + 2]) == 0
        and (maxc <= 0 or redis.call('ZCOUNT', KEYS[i], '(' .. now, '+inf') < maxc) then
      return false
    end
  end
  return true
end
-- The rooms of a budget in use now: its live leases.
local function live(lease)
  return redis.call('ZCOUNT', lease, '(' .. now, '+inf')
end
-- The requests running now on every co-located budget given from KEYS[first] on, as (lease, q, tix) triples.
local function host_others_now(first)
  local n = 0
  for i = first, #KEYS, 3 do n = n + live(KEYS[i]) end
  return n
end
local function inflight(lease, tok)
  local sum = 0
  for _, v in ipairs(redis.call('HVALS', tok)) do sum = sum + tonumber(v) end
  return sum, redis.call('ZCARD', lease)
end
"""

# KEYS: lease, tok, q, qlease, qtok, seq, end, the seven ticket keys (TICKET_KEYS), turn, alive ('' = no guard),
#       recover, since.
# ARGV: request_id, tokens, budget, max_concurrent, lease_ms, mode (0 try, 1 wait, 2 refuse: only a place in line),
#       queue_limit, qlease_ms, expected duration ms (0: none), alive ttl ms, recovery grace ms,
#       presented ticket ('' none), id of a new ticket ('' never issue one), unhinted ticket life ms, ticket limit,
#       lend margin (a request may pass held places whose holders come back after now + margin x its expected
#       duration; 0: it passes none).
# Returns {status, inflight tokens, inflight count, queue length, lease expiry ms, recovering (0/1),
#          ticket held after the call ('' none), presented ticket (0 none, 1 honoured, 2 unknown/expired),
#          and for an honoured ticket that got in: issued ms, hinted ms, first moment its place was free ms,
#          the held place it was lent ('' none)}
# status: 1 reserved, 0 not reserved (mode 0 / 2, or a ticket whose place is not free yet), 2 queued / still
# waiting, 3 queue full.
RESERVE = LUA_COMMON + LUA_LINE + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local budget, maxc, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, qlimit, qlease_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local T = tkeys(8)
purge(KEYS[1], KEYS[2], nil, KEYS[7], KEYS[18])
purge(KEYS[4], KEYS[5], KEYS[3])
purge_tickets(T)
local rec = recovering(KEYS[16], KEYS[17], ARGV[10], ARGV[11])
local sum, count = inflight(KEYS[1], KEYS[2])
local A = {sum = sum, count = count, budget = budget, maxc = maxc, q = KEYS[3], qtok = KEYS[5], lease = KEYS[1],
           tok = KEYS[2]}
purge_lent(A, T)
if not rec then mark_free(A, T) end
if redis.call('ZSCORE', KEYS[1], rid) then
  -- a retried call (e.g. the reply was lost): the reservation exists, renew it
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  return {1, sum, count, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0, '', 0, 0, 0, 0, ''}
end
-- this request's place in line: its ticket's, its queue entry's, or (nil) the end of the line
local tk, tstate, place = ARGV[12], 0, nil
if tk ~= '' then
  local p = redis.call('ZSCORE', T.tix, tk)
  if p then place, tstate = tonumber(p), 1 else tk, tstate = '', 2 end
end
local qs = redis.call('ZSCORE', KEYS[3], rid)
if qs then place = tonumber(qs) end
-- it may pass held places whose holders come back after it is expected to have ended (with the margin)
local expected = tonumber(ARGV[9])
local until_ms = 0
if expected > 0 and tonumber(ARGV[16]) > 0 then until_ms = now + math.ceil(tonumber(ARGV[16]) * expected) end
-- while Redis recovers from a state loss, nothing new gets in: holders are still putting their leases back
local ok, lent_from = false, nil
if mode ~= 2 and not rec then ok, lent_from = admissible(A, T, place, rid, tk, tokens, until_ms) end
if ok then
  -- the budget's turnover: the mean interval between admissions while the line is not empty (each one took a
  -- place that had just come free), the measured pace at which places in the line come free (retry hints). A
  -- ticket holder that came back after its place came free counts from that moment: the service's pace, not
  -- the client's lateness.
  local line = place ~= nil or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', T.tix) > 0
  local at = now
  if tk ~= '' then at = math.min(now, tonumber(redis.call('HGET', T.free, tk) or now)) end
  local last = tonumber(redis.call('HGET', KEYS[15], 'last') or '0')
  -- (a place that was free before the last admission is not the next one in the budget's sequence: skipped)
  if line and last > 0 and at > last and now - last < 30000 then
    local dt = at - last
    local ewma = tonumber(redis.call('HGET', KEYS[15], 'ewma') or '-1')
    ewma = ewma < 0 and dt or (0.8 * ewma + 0.2 * dt)
    redis.call('HSET', KEYS[15], 'ewma', math.floor(ewma))
  end
  redis.call('HSET', KEYS[15], 'last', math.max(at, last))
  redis.call('PEXPIRE', KEYS[15], 3600000)
  redis.call('ZADD', KEYS[1], now + lease_ms, rid)
  redis.call('HSET', KEYS[2], rid, ARGV[2])
  redis.call('ZREM', KEYS[3], rid)
  redis.call('ZREM', KEYS[4], rid)
  redis.call('HDEL', KEYS[5], rid)
  -- the expected end, when the caller gave a duration (none: Admission.retry_after assumes max_wait_s)
  if expected > 0 then redis.call('HSET', KEYS[7], rid, now + expected) end
  -- its admission moment: while it holds its room, its age is a right-censored holding time (HOLDERS)
  redis.call('HSET', KEYS[18], rid, now)
  redis.call('PEXPIRE', KEYS[18], 3600000)
  if lent_from then lend(T, lent_from, rid) end
  local issued, hinted, free = 0, 0, 0
  if tk ~= '' then
    local at = redis.call('HGET', T.at, tk) or (now .. ':' .. now)
    local sep = string.find(at, ':', 1, true)
    issued, hinted = tonumber(string.sub(at, 1, sep - 1)), tonumber(string.sub(at, sep + 1))
    free = tonumber(redis.call('HGET', T.free, tk) or now)
    drop_ticket(T, tk)
  end
  return {1, sum + tokens, count + 1, redis.call('ZCARD', KEYS[3]), now + lease_ms, 0, '', tstate, issued, hinted,
          free, lent_from or ''}
end
local r = rec and 1 or 0
local qlen = redis.call('ZCARD', KEYS[3])
-- a holder back on its ticket is here: its place is not lent while it polls in it (a refusal's hint, SET_HINT,
-- sends it away again)
if tk ~= '' and mode ~= 2 then mark_here(T, tk, now + qlease_ms) end
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
  return {status, sum, count, redis.call('ZCARD', KEYS[3]), 0, r, out, tstate, 0, 0, 0, ''}
end
-- a ticket holder back before its place is free does not queue (admission.py: it waits in its place while that
-- comes free soon, else it is refused at once with a fresh hint and the same place)
if mode ~= 1 or tk ~= '' then return refuse(0) end
if qs then
  redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
  return {2, sum, count, qlen, 0, r, '', tstate, 0, 0, 0, ''}
end
if qlen >= qlimit then return refuse(3) end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), rid)
redis.call('ZADD', KEYS[4], now + qlease_ms, rid)
redis.call('HSET', KEYS[5], rid, ARGV[2])
return {2, sum, count, qlen + 1, 0, r, '', tstate, 0, 0, 0, ''}
"""

# KEYS: lease, tok, end, since. ARGV: request_id, lease_ms. Returns the new expiry (ms), or 0 when the lease is gone
# or expired (renew never revives an expired lease: its tokens may already be promised to someone else; see REASSERT).
RENEW = LUA_COMMON + """
purge(KEYS[1], KEYS[2], nil, KEYS[3], KEYS[4])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return now + tonumber(ARGV[2])
"""

# KEYS: lease, tok, end, since. ARGV: request_id, lease_ms, tokens, expected remaining ms. (A lease put back has no
# admission moment: HOLDERS takes it as a hold of the mean length.)
# Returns {new expiry ms, 1 if the lease was gone and has been put back else 0}. For a request that is running:
# its tokens are in use whether or not Redis remembers them, so a lost lease is put back (and counted), not dropped.
REASSERT = LUA_COMMON + """
purge(KEYS[1], KEYS[2], nil, KEYS[3], KEYS[4])
local lost = 0
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  lost = 1
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], now + tonumber(ARGV[4]))
return {now + tonumber(ARGV[2]), lost}
"""

# KEYS: lease, tok, end, turn, since, q, tix, then (lease, q, tix) of each co-located budget (the same class on the
# clusters sharing this one's host, router/hosts.py). ARGV: request_id, its admission ms (0: unknown),
# max_concurrent (0: a co-located budget counts as saturated only with a line). Returns 1 if this call released the
# lease. A released lease's holding time (admission to release) feeds the budget's mean holding time (turn.hold) and
# its spread (turn.hdev, the mean absolute deviation from it, as TCP's RTT variance): what a typical hold is
# (HOLDERS' censored holders). A hold released while others wait in line (queue entries or held places) also feeds
# turn.shold, the mean hold of the *saturated* service: the pace at which a budget of max_concurrent rooms frees
# places for a line (retry hints; HOLDERS adds the holds in progress). Holds released to nobody are left out of it:
# they are the service at low load (a burst's tail, whose last requests run alone and fast), and a line only forms
# again under load (paced by every hold, a burst's first hints came 2-4x early; docs/architecture.md §13).
# Clusters that share a host's cores slow each other, so the same holds also feed turn.hshold, the mean hold of a
# saturated *host*, while every co-located budget is saturated too (host_saturated): the pace HOLDERS uses while
# the host is saturated (a cluster whose line drains last runs its last holds alone on the host, fast, and would
# make its next burst's first hints early). A neighbour's line counts while its holders are away and its rooms
# idle, so a hold weighs in hshold by the share of the host's rooms in use at its release (all of them: 0.2, as in
# shold): a host running few requests says little of it saturated. Stricter rules and per-load means made paces
# that their own slow lines never corrected (docs/architecture.md §13).
# With no co-located budget and all its rooms in use, hshold is shold.
RELEASE = LUA_COMMON + """
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
local since = tonumber(ARGV[2])
local function ewma(field, x, w)
  local m = tonumber(redis.call('HGET', KEYS[4], field) or '-1')
  m = m < 0 and x or ((1 - w) * m + w * x)
  redis.call('HSET', KEYS[4], field, math.floor(m))
end
if removed == 1 and since > 0 and now > since and now - since < 600000 then
  local x = now - since
  local hold = tonumber(redis.call('HGET', KEYS[4], 'hold') or '-1')
  local dev = tonumber(redis.call('HGET', KEYS[4], 'hdev') or '0')
  if hold < 0 then hold = x else dev, hold = 0.75 * dev + 0.25 * math.abs(x - hold), 0.8 * hold + 0.2 * x end
  redis.call('HSET', KEYS[4], 'hold', math.floor(hold), 'hdev', math.floor(dev))
  if redis.call('ZCARD', KEYS[6]) > 0 or redis.call('ZCARD', KEYS[7]) > 0 then
    ewma('shold', x, 0.2)
    local maxc = tonumber(ARGV[3])
    if host_saturated(8, maxc) then
      -- weighed by the share of the host's rooms in use at the release (all of them: 0.2, as shold)
      local rooms = maxc * (1 + (#KEYS - 7) / 3)
      local used = live(KEYS[1]) + 1 + host_others_now(8)
      ewma('hshold', x, rooms > 0 and 0.2 * math.min(used / rooms, 1) or 0.2)
    end
  end
  redis.call('PEXPIRE', KEYS[4], 3600000)
end
return removed
"""

# KEYS: alive, recover. ARGV: alive ttl ms, grace ms. The renewer's beat: returns 1 while recovering.
TOUCH = LUA_COMMON + """
return recovering(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) and 1 or 0
"""

# KEYS: lease, tok, q, qlease, qtok, end, the seven ticket keys, since (optional). ARGV: budget, max_concurrent.
# Returns {inflight tokens, inflight count, queue length, held places, held places lent to a borrower in flight}.
STATS = LUA_COMMON + LUA_LINE + """
local T = tkeys(7)
purge(KEYS[1], KEYS[2], nil, KEYS[6], KEYS[14])
purge(KEYS[4], KEYS[5], KEYS[3])
purge_tickets(T)
local sum, count = inflight(KEYS[1], KEYS[2])
local A = {sum = sum, count = count, budget = tonumber(ARGV[1]), maxc = tonumber(ARGV[2]), q = KEYS[3],
           qtok = KEYS[5], lease = KEYS[1], tok = KEYS[2]}
purge_lent(A, T)
if A.maxc > 0 then mark_free(A, T) end
return {sum, count, redis.call('ZCARD', KEYS[3]), redis.call('ZCARD', T.tix), redis.call('HLEN', T.lent)}
"""

# KEYS: lease, tok, q, qtok, end, turn, the seven ticket keys, since, then (lease, q, tix) of each co-located budget
# (as RELEASE). ARGV: ticket id ('' = the end of the line), censored factor, typical spread
# (retry_hint.CENSORED_FACTOR, TYPICAL_SPREAD), max_concurrent (as RELEASE). Returns {now ms, waiters ahead, their
# tokens, turnover ms (-1: not measured), last admission ms (-1: none), mean holding time ms (-1: not measured),
# tokens_1, end_1, censored_1, bound_1, tokens_2, ...} over the live leases (end -1: none published; censored 1: the
# end is the censored estimate below, 0: it is the published one; bound: the end the hold is expected to reach, the
# censored estimate or admission + the pace, -1: unknown).
# Waiters ahead: queue entries and held places before the ticket's place (all of them for ''), counted as the line
# rule counts them (a held place lent to a borrower in flight while its holder is away is no place: its borrower is
# among the leases).
# A hold in progress is a right-censored holding time: a holder of age a will hold its room at least a. While a is
# within what the completed holds make typical (their mean + spread x their mean absolute deviation, RELEASE) that
# says nothing new; past it, nothing seen says when it ends, and it is taken to hold its room factor x a in all (its
# age as likely any fraction of its whole: the median of a lifetime seen only to have lasted a is 2a). Its end is
# then no earlier than admission + factor x a: holders that outlast every recent hold show at once that the service
# has slowed (a burst), without waiting for one of them to end and for the completed holds' mean to follow.
HOLDERS = LUA_COMMON + LUA_LINE + """
local T = tkeys(7)
local A = {maxc = 1e9, q = KEYS[3], qtok = KEYS[4], lease = KEYS[1], tok = KEYS[2]}
local place = nil
if ARGV[1] ~= '' then place = redis.call('ZSCORE', T.tix, ARGV[1]) end
local s, c = line_ahead(A, T, place, '', 0)
local hold = tonumber(redis.call('HGET', KEYS[6], 'hold') or '-1')
local typical = hold + tonumber(ARGV[3]) * tonumber(redis.call('HGET', KEYS[6], 'hdev') or '0')
-- the pace of places: the saturated host's mean hold while the host is saturated, else the saturated service's
-- (RELEASE); the mean of every hold before a line was seen
local pace = -1
if host_saturated(15, tonumber(ARGV[4])) then pace = tonumber(redis.call('HGET', KEYS[6], 'hshold') or '-1') end
if pace < 0 then pace = tonumber(redis.call('HGET', KEYS[6], 'shold') or '-1') end
if pace < 0 then pace = hold end
local out = {now, c, s, tonumber(redis.call('HGET', KEYS[6], 'ewma') or '-1'),
             tonumber(redis.call('HGET', KEYS[6], 'last') or '-1'), pace}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  local e = tonumber(redis.call('HGET', KEYS[5], rid) or '-1')
  local since = tonumber(redis.call('HGET', KEYS[14], rid) or '-1')  -- none: a lease put back after a state loss
  local censored = 0
  if hold >= 0 and since >= 0 and now - since > typical then
    local whole = since + math.floor(tonumber(ARGV[2]) * (now - since))
    if whole > e then e, censored = whole, 1 end
  end
  -- the end its hold is expected to reach: the censored estimate, else admission + the pace (a typical hold)
  local bound = -1
  if censored == 1 then bound = e elseif since >= 0 and pace > 0 then bound = since + pace end
  table.insert(out, tonumber(redis.call('HGET', KEYS[2], rid) or '0'))
  table.insert(out, e)
  table.insert(out, censored)
  table.insert(out, bound)
end
return out
"""

# KEYS: the seven ticket keys. ARGV: ticket id, hint ms, grace ms. The hint handed out with a ticket: its place is
# held until grace after the hinted moment, and its holder is away until then. Returns the hinted moment (ms), 0:
# no such ticket.
SET_HINT = LUA_COMMON + LUA_LINE + """
local T = tkeys(1)
if not redis.call('ZSCORE', T.tix, ARGV[1]) then return 0 end
local at = now + tonumber(ARGV[2])
redis.call('ZADD', T.exp, at + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', T.at, ARGV[1], now .. ':' .. at)
redis.call('ZREM', T.here, ARGV[1])
fit_keys(T)
return at
"""

# KEYS: the seven ticket keys. ARGV: ticket id. A ticket given up (its holder was cancelled or went to another
# budget): its place is free at once. Returns 1 if it existed.
DROP_TICKET = LUA_COMMON + LUA_LINE + """
local T = tkeys(1)
local existed = redis.call('ZSCORE', T.tix, ARGV[1]) and 1 or 0
drop_ticket(T, ARGV[1])
return existed
"""
