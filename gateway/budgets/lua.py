"""The Lua scripts of ``RedisBudgetStore``: the algorithm of ``gateway.budgets.store`` in Redis.

Key layout (``P`` is the configured prefix, ``kvgate:budget`` by default; ``sid`` a sanitized
session id, which never contains a space):

==================  ======  =====================================================================
key                 type    content
==================  ======  =====================================================================
``P:s:<sid>``       hash    session state: ``ts`` (last refill), ``x`` (expiry, invariant 5),
                            ``ew`` (hold EWMA s), ``ew_at`` (its update), buckets
                            ``bs``/``rq``/``tk`` with ``<b>_c`` capacity (-1: unlimited) and
                            ``<b>_r`` refill per second; throttle ``th`` (state), ``th_e``
                            (expiry), ``th_m`` (max in flight, -1: none), ``th_f`` (factor),
                            ``th_why``, ``th_at``
``P:r:<sid>``       hash    reservations in flight: ``rid -> "kv_bytes tokens started lease_exp"``
``P:top``           zset    ``sid`` scored by its KV bytes in flight (only sessions with > 0)
``P:leases``        zset    ``"<sid> <rid>"`` scored by lease expiry, for the global sweep
``P:throttled``     zset    ``sid`` scored by throttle expiry
==================  ======  =====================================================================

Invariants every script keeps (each script is one atomic unit, so they hold between scripts):

1. ``P:top[sid]`` = sum of ``kv_bytes`` over ``P:r:<sid>``, and is absent when that sum is 0; the
   in-flight bytes and count are derived from ``P:r:<sid>`` at every call, never kept as counters,
   so nothing can drift.
2. each entry of ``P:r:<sid>`` has exactly one ``P:leases`` member with its lease expiry as score.
3. ``P:throttled[sid]`` exists iff ``P:s:<sid>`` has a throttle, with the same expiry.
4. every bucket level is at most its capacity; ``rq`` and ``tk`` are >= 0; ``bs`` >= -capacity.
5. a session with nothing in flight, no throttle, full buckets and no hold history has no keys at
   all; any other session's state carries ``x``, the clock time at which it will equal a fresh
   one (a pure function of the state, so reads never extend it: it counts the refill after a dead
   holder's charge, the throttle's expiry, each bucket's refill, and ``ew_at + MIN_TTL`` for the
   hold EWMA), and state read after ``x`` is treated as fresh. Its keys get a TTL of
   ``max(x - now, MIN_TTL) + 1 s`` (real time; ``MIN_TTL`` absorbs clock skew), so abandoned state
   is collected even if no script touches it again.

Lazily maintained: expired leases and throttles are removed by the next script that opens the
session, or by the sweep in the top-K and throttled-list scripts, which reaps at most ``LIMIT``
expired leases per call from ``P:leases``.

Times come from the caller (``ARGV[2]``, the gateway's wall clock), not ``TIME``: the tests drive a
manual clock, and gateways are expected to run NTP; a skew of ``d`` seconds between gateways only
shifts refills and lease expiries by ``d``. Numbers leave Lua as strings (``%.17g``) because Redis
truncates Lua numbers in replies to integers.

Keys are built inside the scripts from the prefix, so the store needs a standalone Redis (or a
primary behind Sentinel), not Redis Cluster. Cost: O(reservations in flight of the session) per
call plus O(log n) sorted-set updates.
"""

from __future__ import annotations

PRELUDE = r"""
local P = ARGV[1]
local NOW = tonumber(ARGV[2])
local MIN_TTL = tonumber(ARGV[3])
local TOP = P .. ':top'
local LEASES = P .. ':leases'
local THROTTLED = P .. ':throttled'
local BUCKETS = {'bs', 'rq', 'tk'}
local EWMA_W = 0.2

local function skey(sid) return P .. ':s:' .. sid end
local function rkey(sid) return P .. ':r:' .. sid end
local function fmt(x) return string.format('%.17g', x) end
local function num(v, d)
  if v == nil or v == false then return d end
  return tonumber(v)
end

local function charge(st, amount)
  if st.bs_c >= 0 and amount > 0 then
    st.bs = math.max(-st.bs_c, st.bs - amount)
  end
end

-- refill every bucket up to time t (never backwards: clocks may disagree)
local function advance(st, t)
  local dt = t - st.ts
  if dt > 0 then
    for _, b in ipairs(BUCKETS) do
      if st[b .. '_c'] >= 0 then
        st[b] = math.min(st[b .. '_c'], st[b] + st[b .. '_r'] * dt)
      end
    end
    st.ts = t
  end
end

-- open: load, expire the throttle, reap expired leases, refill to NOW.
local function open(sid)
  local flat = redis.call('HGETALL', skey(sid))
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  if h.x and tonumber(h.x) <= NOW then
    -- expired state is fresh: every lease in it was charged and refilled by now
    for _, rid in ipairs(redis.call('HKEYS', rkey(sid))) do
      redis.call('ZREM', LEASES, sid .. ' ' .. rid)
    end
    redis.call('DEL', rkey(sid))
    redis.call('ZREM', THROTTLED, sid)
    h = {}
  end
  local st = {
    ts = num(h.ts, NOW), ew = num(h.ew, -1), ew_at = num(h.ew_at, 0),
    th = h.th, th_e = num(h.th_e, 0), th_m = num(h.th_m, -1), th_f = num(h.th_f, 1),
    th_why = h.th_why or '', th_at = num(h.th_at, 0),
  }
  for _, b in ipairs(BUCKETS) do
    local cap = num(h[b .. '_c'], -1)
    st[b .. '_c'] = cap
    st[b .. '_r'] = num(h[b .. '_r'], 0)
    st[b] = num(h[b], cap)
  end
  if st.th and st.th_e <= NOW then
    st.th = nil
    redis.call('ZREM', THROTTLED, sid)
  end
  if st.ew >= 0 and st.ew_at + MIN_TTL <= NOW then st.ew = -1 end
  local live, expired = {}, {}
  local rflat = redis.call('HGETALL', rkey(sid))
  for i = 1, #rflat, 2 do
    local b, t, s0, e = string.match(rflat[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
    local r = {id = rflat[i], b = tonumber(b), t = tonumber(t), s = tonumber(s0), e = tonumber(e)}
    if r.e <= NOW then expired[#expired + 1] = r else live[#live + 1] = r end
  end
  table.sort(expired, function(x, y) return x.e < y.e or (x.e == y.e and x.id < y.id) end)
  for _, r in ipairs(expired) do
    -- charged as released when its lease ran out, with the refill before and after
    advance(st, r.e)
    redis.call('HDEL', rkey(sid), r.id)
    redis.call('ZREM', LEASES, sid .. ' ' .. r.id)
    charge(st, r.b * (r.e - r.s))
  end
  advance(st, NOW)
  st.live = live
  return st
end

local function inflight_bytes(st)
  local ib = 0
  for _, r in ipairs(st.live) do ib = ib + r.b end
  return ib
end

local function accrued(st)
  local a = 0
  for _, r in ipairs(st.live) do a = a + r.b * math.max(0, NOW - r.s) end
  return a
end

-- commit: top index, fresh-state deletion, write-back with a TTL. Returns true if kept.
local function commit(sid, st)
  local ib, maxe = 0, 0
  for _, r in ipairs(st.live) do
    ib = ib + r.b
    if r.e > maxe then maxe = r.e end
  end
  if ib > 0 then redis.call('ZADD', TOP, ib, sid) else redis.call('ZREM', TOP, sid) end
  -- x: when this state will equal a fresh one, a pure function of the state (reads never
  -- extend it); the same expression, in the same order, as MemoryBudgetStore's keep_until
  local keep, differs = NOW, false
  if #st.live > 0 then
    differs = true
    keep = maxe
    if st.bs_c >= 0 and st.bs_r > 0 then keep = keep + 2 * st.bs_c / st.bs_r end
  end
  if st.th then
    differs = true
    keep = math.max(keep, st.th_e)
  end
  for _, b in ipairs(BUCKETS) do
    local cap = st[b .. '_c']
    if cap >= 0 and st[b] < cap then
      differs = true
      if st[b .. '_r'] > 0 then keep = math.max(keep, NOW + (cap - st[b]) / st[b .. '_r']) end
    end
  end
  if st.ew >= 0 then
    differs = true
    keep = math.max(keep, st.ew_at + MIN_TTL)
  end
  redis.call('DEL', skey(sid))
  if not differs then
    redis.call('DEL', rkey(sid))
    return false
  end
  local f = {'ts', fmt(st.ts), 'x', fmt(keep)}
  if st.ew >= 0 then
    f[#f + 1] = 'ew'; f[#f + 1] = fmt(st.ew); f[#f + 1] = 'ew_at'; f[#f + 1] = fmt(st.ew_at)
  end
  for _, b in ipairs(BUCKETS) do
    f[#f + 1] = b .. '_c'; f[#f + 1] = fmt(st[b .. '_c'])
    if st[b .. '_c'] >= 0 then
      f[#f + 1] = b; f[#f + 1] = fmt(st[b])
      f[#f + 1] = b .. '_r'; f[#f + 1] = fmt(st[b .. '_r'])
    end
  end
  if st.th then
    for _, kv in ipairs({{'th', st.th}, {'th_e', fmt(st.th_e)}, {'th_m', fmt(st.th_m)},
                         {'th_f', fmt(st.th_f)}, {'th_why', st.th_why}, {'th_at', fmt(st.th_at)}}) do
      f[#f + 1] = kv[1]; f[#f + 1] = kv[2]
    end
  end
  redis.call('HSET', skey(sid), unpack(f))
  -- the key TTL only collects garbage (real time); MIN_TTL absorbs clock skew between gateways
  local ttl_ms = math.ceil((math.max(keep - NOW, MIN_TTL) + 1) * 1000)
  redis.call('PEXPIRE', skey(sid), ttl_ms)
  if #st.live > 0 then redis.call('PEXPIRE', rkey(sid), ttl_ms) end
  return true
end

local function usage_row(sid, st)
  local function opt(cap, v) if cap < 0 then return '' end return fmt(v) end
  return {
    sid, fmt(inflight_bytes(st)), fmt(#st.live),
    opt(st.bs_c, st.bs - accrued(st)), opt(st.bs_c, st.bs_c),
    opt(st.rq_c, st.rq), opt(st.rq_c, st.rq_c),
    opt(st.tk_c, st.tk), opt(st.tk_c, st.tk_c),
    opt(st.ew, st.ew),
    st.th or '', fmt(st.th_e), fmt(st.th_m), fmt(st.th_f), st.th_why, fmt(st.th_at),
  }
end

-- sweep: reap sessions with expired leases or throttles, at most LIMIT of each.
local function sweep(limit)
  local seen = {}
  local members = redis.call('ZRANGEBYSCORE', LEASES, '-inf', NOW, 'LIMIT', 0, limit)
  for _, m in ipairs(members) do
    local sid = string.match(m, '^(%S+) ')
    if sid and not seen[sid] then
      seen[sid] = true
      commit(sid, open(sid))
    end
    -- a member whose reservation hash already expired has nothing left to reap
    redis.call('ZREM', LEASES, m)
  end
  local sids = redis.call('ZRANGEBYSCORE', THROTTLED, '-inf', NOW, 'LIMIT', 0, limit)
  for _, sid in ipairs(sids) do
    if not seen[sid] then
      seen[sid] = true
      commit(sid, open(sid))
    end
    redis.call('ZREM', THROTTLED, sid)
  end
end
"""

# ARGV: P, now, min_ttl, sid, rid, lease_ttl, kv_bytes, tokens, inflight_kv_bytes,
#       inflight_requests, kv_byte_seconds, window_s, rpm, tpm  (-1: unlimited)
# -> {1, lease_expires_at} | {0, limit, retry_after (-1: never), throttle state or ''}
RESERVE = (
    PRELUDE
    + r"""
local sid, rid = ARGV[4], ARGV[5]
local lease_ttl, bytes, tokens = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local max_b, max_n = tonumber(ARGV[9]), tonumber(ARGV[10])
local caps = {bs = tonumber(ARGV[11]), rq = tonumber(ARGV[13]), tk = tonumber(ARGV[14])}
local periods = {bs = tonumber(ARGV[12]), rq = 60, tk = 60}
local st = open(sid)
for _, r in ipairs(st.live) do
  if r.id == rid then
    commit(sid, st)
    return {1, fmt(r.e)}
  end
end
local th_left = 0
if st.th then
  th_left = st.th_e - NOW
  if st.th == 'blocked' then
    commit(sid, st)
    return {0, 'blocked', fmt(th_left), 'blocked'}
  end
  local f = st.th_f
  if max_b >= 0 then max_b = math.floor(max_b * f) end
  if st.th_m >= 0 and (max_n < 0 or st.th_m < max_n) then max_n = st.th_m end
  for _, b in ipairs(BUCKETS) do
    if caps[b] >= 0 then caps[b] = caps[b] * f end
  end
end
for _, b in ipairs(BUCKETS) do
  local cap = caps[b]
  if cap < 0 then
    st[b .. '_c'] = -1; st[b .. '_r'] = 0
  else
    -- a full bucket stays full: "full" and "no bucket" are one state (see commit)
    if st[b .. '_c'] < 0 or st[b] >= st[b .. '_c'] then
      st[b] = cap
    else
      st[b] = math.min(math.max(st[b], -cap), cap)
    end
    st[b .. '_c'] = cap; st[b .. '_r'] = cap / periods[b]
  end
end

local function slot_wait(free_n, free_b)
  table.sort(st.live, function(x, y) return x.s < y.s or (x.s == y.s and x.id < y.id) end)
  local fn, fb = 0, 0
  local ew = math.max(st.ew, 0)
  for _, r in ipairs(st.live) do
    fn = fn + 1; fb = fb + r.b
    if fn >= free_n and fb >= free_b then return math.max(0, r.s + ew - NOW) end
  end
  return -1
end
local function bucket_wait(b, needed)
  local rate = st[b .. '_r']
  if rate <= 0 then return -1 end
  return math.max(0, (needed - st[b]) / rate)
end

local count, ib = #st.live, inflight_bytes(st)
local limit, wait = nil, 0
if max_n >= 0 and count + 1 > max_n then
  limit = 'inflight_requests'; wait = slot_wait(count + 1 - max_n, 0)
elseif max_b >= 0 and ib + bytes > max_b then
  limit = 'inflight_kv_bytes'; wait = slot_wait(0, ib + bytes - max_b)
elseif st.bs_c >= 0 and st.bs - accrued(st) <= 0 then
  limit = 'kv_byte_seconds'; wait = bucket_wait('bs', accrued(st))
elseif st.rq_c >= 0 and st.rq < 1 then
  limit = 'requests_per_minute'; wait = bucket_wait('rq', 1)
elseif st.tk_c >= 0 and st.tk < tokens then
  limit = 'tokens_per_minute'; wait = bucket_wait('tk', tokens)
end
if limit then
  if st.th then
    if wait < 0 then wait = th_left else wait = math.min(wait, th_left) end
  end
  local th = st.th or ''
  commit(sid, st)
  return {0, limit, fmt(wait), th}
end
local e = NOW + lease_ttl
redis.call('HSET', rkey(sid), rid,
  fmt(bytes) .. ' ' .. fmt(tokens) .. ' ' .. fmt(NOW) .. ' ' .. fmt(e))
redis.call('ZADD', LEASES, e, sid .. ' ' .. rid)
st.live[#st.live + 1] = {id = rid, b = bytes, t = tokens, s = NOW, e = e}
if st.rq_c >= 0 then st.rq = st.rq - 1 end
if st.tk_c >= 0 then st.tk = st.tk - tokens end
commit(sid, st)
return {1, fmt(e)}
"""
)

# ARGV: P, now, min_ttl, sid, rid, actual_tokens (-1: unknown) -> 1 released | 0 not held
RELEASE = (
    PRELUDE
    + r"""
local sid, rid, actual = ARGV[4], ARGV[5], tonumber(ARGV[6])
if redis.call('EXISTS', skey(sid)) == 0 and redis.call('EXISTS', rkey(sid)) == 0 then
  return 0
end
local st = open(sid)
local found = 0
for i, r in ipairs(st.live) do
  if r.id == rid then
    table.remove(st.live, i)
    redis.call('HDEL', rkey(sid), rid)
    redis.call('ZREM', LEASES, sid .. ' ' .. rid)
    local held = math.max(0, NOW - r.s)
    charge(st, r.b * held)
    if st.ew < 0 then st.ew = held else st.ew = (1 - EWMA_W) * st.ew + EWMA_W * held end
    st.ew_at = NOW
    if st.tk_c >= 0 and actual >= 0 and actual < r.t then
      st.tk = math.min(st.tk_c, st.tk + (r.t - actual))
    end
    found = 1
    break
  end
end
commit(sid, st)
return found
"""
)

# ARGV: P, now, min_ttl, sid, rid, lease_ttl -> new expiry | false when not held
RENEW = (
    PRELUDE
    + r"""
local sid, rid, lease_ttl = ARGV[4], ARGV[5], tonumber(ARGV[6])
if redis.call('EXISTS', rkey(sid)) == 0 then return false end
local st = open(sid)
local out = false
for _, r in ipairs(st.live) do
  if r.id == rid then
    r.e = NOW + lease_ttl
    redis.call('HSET', rkey(sid), rid,
      fmt(r.b) .. ' ' .. fmt(r.t) .. ' ' .. fmt(r.s) .. ' ' .. fmt(r.e))
    redis.call('ZADD', LEASES, r.e, sid .. ' ' .. rid)
    out = fmt(r.e)
    break
  end
end
commit(sid, st)
return out
"""
)

# ARGV: P, now, min_ttl, sid, state, expires_at, max_inflight (-1: none), factor, reason, set_at
SET_THROTTLE = (
    PRELUDE
    + r"""
local sid = ARGV[4]
local st = open(sid)
local exp = tonumber(ARGV[6])
if exp > NOW then
  st.th = ARGV[5]; st.th_e = exp; st.th_m = tonumber(ARGV[7]); st.th_f = tonumber(ARGV[8])
  st.th_why = ARGV[9]; st.th_at = tonumber(ARGV[10])
  redis.call('ZADD', THROTTLED, exp, sid)
else
  st.th = nil
  redis.call('ZREM', THROTTLED, sid)
end
commit(sid, st)
return 1
"""
)

# ARGV: P, now, min_ttl, sid -> 1 when a throttle was removed, else 0
CLEAR_THROTTLE = (
    PRELUDE
    + r"""
local sid = ARGV[4]
if redis.call('EXISTS', skey(sid)) == 0 then return 0 end
local st = open(sid)
local had = 0
if st.th then had = 1 end
st.th = nil
redis.call('ZREM', THROTTLED, sid)
commit(sid, st)
return had
"""
)

# ARGV: P, now, min_ttl, sid -> usage row | false for a fresh session
USAGE = (
    PRELUDE
    + r"""
local sid = ARGV[4]
if redis.call('EXISTS', skey(sid)) == 0 and redis.call('EXISTS', rkey(sid)) == 0 then
  return false
end
local st = open(sid)
if not commit(sid, st) then return false end
return usage_row(sid, st)
"""
)

# ARGV: P, now, min_ttl, k, sweep_limit -> usage rows, most KV in flight first
TOP = (
    PRELUDE
    + r"""
local k, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
sweep(limit)
local out = {}
if k <= 0 then return out end
local sids = redis.call('ZREVRANGE', TOP, 0, k - 1)
for _, sid in ipairs(sids) do
  local st = open(sid)
  if commit(sid, st) and inflight_bytes(st) > 0 then out[#out + 1] = usage_row(sid, st) end
end
return out
"""
)

# ARGV: P, now, min_ttl, limit -> usage rows of throttled sessions, soonest expiry first
THROTTLED_LIST = (
    PRELUDE
    + r"""
local limit = tonumber(ARGV[4])
sweep(limit)
local out = {}
if limit <= 0 then return out end
local sids = redis.call('ZRANGE', THROTTLED, 0, limit - 1)
for _, sid in ipairs(sids) do
  local st = open(sid)
  if commit(sid, st) and st.th then out[#out + 1] = usage_row(sid, st) end
end
return out
"""
)
