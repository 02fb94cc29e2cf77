"""The Lua of one (cluster, class)'s line: held places (retry tickets) and lending them (admission_lua.py's scripts
include it; the design is in router/tickets.py, "Lending").

T: the seven ticket keys of one (cluster, class), ``TICKET_KEYS`` in order:

    tix     ZSET  ticket -> place (from the queue's arrival counter)
    tixexp  ZSET  ticket -> expiry (ms): hinted moment + grace
    tixtok  HASH  ticket -> tokens
    tixat   HASH  ticket -> "issued ms:hinted ms"
    tixfree HASH  ticket -> first moment (ms) its place was seen free
    tixlent HASH  ticket -> request id of the borrower its place is lent to (stale once that lease is gone)
    tixhere ZSET  ticket -> presence expiry (ms): its holder is back, polling in its place

A: {sum, count, budget, maxc, q, qtok, lease, tok} of the budget (in-flight tokens and count, the class limits and
the queue's and leases' keys). Needs LUA_COMMON (``now``).
"""

TICKET_KEYS = ("tix", "tixexp", "tixtok", "tixat", "tixfree", "tixlent", "tixhere")

LUA_LINE = """
local function tkeys(i)
  return {tix = KEYS[i], exp = KEYS[i + 1], tok = KEYS[i + 2], at = KEYS[i + 3], free = KEYS[i + 4],
          lent = KEYS[i + 5], here = KEYS[i + 6]}
end
local function fits_in(A, t, s, c) return c == 0 or (s + t <= A.budget and c < A.maxc) end
local function purge_tickets(T)
  redis.call('ZREMRANGEBYSCORE', T.here, '-inf', now)
  while true do
    local dead = redis.call('ZRANGEBYSCORE', T.exp, '-inf', now, 'LIMIT', 0, 500)
    if #dead == 0 then return end
    for _, k in ipairs({T.exp, T.tix, T.here}) do redis.call('ZREM', k, unpack(dead)) end
    for _, k in ipairs({T.tok, T.at, T.free, T.lent}) do redis.call('HDEL', k, unpack(dead)) end
  end
end
-- a lend ends with its borrower's lease (released or expired): forget it
local function purge_lent(A, T)
  local lent = redis.call('HGETALL', T.lent)
  for i = 1, #lent, 2 do
    if not redis.call('ZSCORE', A.lease, lent[i + 1]) then redis.call('HDEL', T.lent, lent[i]) end
  end
end
local function drop_ticket(T, id)
  for _, k in ipairs({T.tix, T.exp, T.here}) do redis.call('ZREM', k, id) end
  for _, k in ipairs({T.tok, T.at, T.free, T.lent}) do redis.call('HDEL', k, id) end
end
local function all_keys(T) return {T.tix, T.exp, T.tok, T.at, T.free, T.lent, T.here} end
-- the ticket keys live no longer than their last ticket (keys of unadmitted requests expire fast)
local function keep_keys(T, until_ms)
  local ttl = until_ms - now + 1000
  for _, k in ipairs(all_keys(T)) do
    local cur = redis.call('PTTL', k)
    if cur ~= -2 and cur < ttl then redis.call('PEXPIRE', k, ttl) end
  end
end
-- ... and exactly as long as the latest ticket (after a hint shortened one from its unhinted life)
local function fit_keys(T)
  local last = redis.call('ZRANGE', T.exp, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local ttl = math.max(tonumber(last[2]) - now, 0) + 1000
  for _, k in ipairs(all_keys(T)) do
    if redis.call('EXISTS', k) == 1 then redis.call('PEXPIRE', k, ttl) end
  end
end
-- a side key written after the ticket keys got their life: it lives as long as the held places
local function as_long_as_tix(T, k) redis.call('PEXPIRE', k, math.max(redis.call('PTTL', T.tix), 1000)) end
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
-- its holder is back (polling in its place) until until_ms
local function mark_here(T, id, until_ms)
  redis.call('ZADD', T.here, until_ms, id)
  as_long_as_tix(T, T.here)
end
local function here(T, id) return tonumber(redis.call('ZSCORE', T.here, id) or '0') > now end
-- the hinted moment (ms) of a held place; 0 while it has none yet
local function hinted_ms(T, id)
  local at = redis.call('HGET', T.at, id)
  if not at then return 0 end
  local sep = string.find(at, ':', 1, true)
  local issued, hinted = tonumber(string.sub(at, 1, sep - 1)), tonumber(string.sub(at, sep + 1))
  return hinted > issued and hinted or 0
end
-- the borrower of held place id while it is in flight (nil: not lent, or the borrower ended)
local function borrower(A, T, id)
  local b = redis.call('HGET', T.lent, id)
  if b and redis.call('ZSCORE', A.lease, b) then return b end
  return nil
end
local function lease_tokens(A, rid) return tonumber(redis.call('HGET', A.tok, rid) or '0') end
-- What the line ahead of `place` (nil: its end) takes from a request whose own queue entry is `self`:
--   s, c   tokens and places of the queue entries and held places ahead. A held place lent to a borrower in flight
--          while its holder is away takes no place (its room is the borrower's, counted in flight) and its tokens
--          less the borrower's (so that lending changes nobody else's count: the borrower stands in for it).
--   ps, pc, first  (until_ms > 0) the held places ahead that a request ending by until_ms may pass: holder away,
--          not lent, hinted to come back at or after until_ms; and the first of them in line.
-- Counting stops once c reaches maxc: nothing fits beyond that.
local function line_ahead(A, T, place, self, until_ms)
  local hi = place and ('(' .. place) or '+inf'
  local s, c, ps, pc, first = 0, 0, 0, 0, nil
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', A.q, '-inf', hi, 'LIMIT', 0, A.maxc + 1)) do
    if id ~= self then s, c = s + tonumber(redis.call('HGET', A.qtok, id) or '0'), c + 1 end
  end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', T.tix, '-inf', hi, 'LIMIT', 0, 2048)) do
    if c >= A.maxc then break end
    local t = tonumber(redis.call('HGET', T.tok, id) or '0')
    local away = not here(T, id)
    local b = away and borrower(A, T, id)
    if b then
      s = s + t - lease_tokens(A, b)
    elseif until_ms > 0 and away and hinted_ms(T, id) >= until_ms then
      ps, pc, first = ps + t, pc + 1, first or id
    else
      s, c = s + t, c + 1
    end
  end
  return s, c, ps, pc, first
end
-- in flight (tokens, count), less the borrower of held place `own` ('' none): the room that is the place's own
local function in_flight_but_own(A, T, own)
  local b = own ~= '' and borrower(A, T, own)
  if b then return A.sum - lease_tokens(A, b), A.count - 1 end
  return A.sum, A.count
end
-- The line rule for a request of t tokens at `place` (nil: a newcomer), queue entry `self`, held place `own`: it
-- fits with everything ahead of it in line counted as taken (waiters and held places, lent ones as above). So
-- nobody passes a request ahead unless that one still fits too: an oversized head (it runs alone) holds up everyone
-- behind it.
local function line_fits(A, T, place, self, own, t)
  local s0, c0 = in_flight_but_own(A, T, own)
  local s, c = line_ahead(A, T, place, self, 0)
  return fits_in(A, t, s0 + s, c0 + c)
end
-- Admission: the room must be there now (what is in flight, borrowers included: budgets are never exceeded), and
-- the line rule must hold, or hold once the request passes the held places it may pass (expected to end by
-- until_ms, before their holders come back: 0 passes none). Returns (admit, the held place it is lent: the first
-- it passes, nil when it passed none).
local function admissible(A, T, place, self, own, t, until_ms)
  if not fits_in(A, t, A.sum, A.count) then return false, nil end
  local s0, c0 = in_flight_but_own(A, T, own)
  local s, c, ps, pc, first = line_ahead(A, T, place, self, until_ms)
  if fits_in(A, t, s0 + s + ps, c0 + c + pc) then return true, nil end
  if first and fits_in(A, t, s0 + s, c0 + c) then return true, first end
  return false, nil
end
local function lend(T, id, rid)
  redis.call('HSET', T.lent, id, rid)
  as_long_as_tix(T, T.lent)
end
-- Stamp the first moment each held place is free by the line rule (its holder would be admitted now, were it
-- here: a lent place's own borrower is in its room only while the holder is away): the hint's accuracy.
local function mark_free(A, T)
  local first = redis.call('ZRANGE', T.tix, 0, 2 * A.maxc, 'WITHSCORES')
  for i = 1, #first, 2 do
    local id = first[i]
    if redis.call('HEXISTS', T.free, id) == 0 then
      local t = tonumber(redis.call('HGET', T.tok, id) or '0')
      if line_fits(A, T, tonumber(first[i + 1]), '', id, t) then
        redis.call('HSET', T.free, id, now)
        as_long_as_tix(T, T.free)
      end
    end
  end
end
"""
