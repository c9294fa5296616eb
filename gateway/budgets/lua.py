"""The Lua scripts of ``RedisBudgetStore``: the algorithm of ``gateway.budgets.store`` in Redis.

Key layout (``P`` is the configured prefix, ``kvgate:budget`` by default; ``T`` the tenant, ``sid``
a sanitized session id; neither contains a space or a brace). ``{T}`` is a Redis Cluster hash
tag: every key of one tenant lives in one slot, and every script touches one tenant's keys only,
all passed as ``KEYS`` (none is built inside a script), so the store runs on Redis Cluster and
Valkey as on a standalone Redis:

=====================  ======  ==================================================================
key                    type    content
=====================  ======  ==================================================================
``P:{T}:s:<sid>``      hash    session state: ``ts`` (last refill), ``x`` (expiry, invariant 5),
                               ``ew`` (hold EWMA s), ``ew_at`` (its update), buckets
                               ``bs``/``rq``/``tk`` with ``<b>_c`` capacity (-1: unlimited) and
                               ``<b>_r`` refill per second; throttle ``th`` (state), ``th_e``
                               (expiry), ``th_m`` (max in flight, -1: none), ``th_f`` (factor),
                               ``th_why``, ``th_at``
``P:{T}:r:<sid>``      hash    the session's reservations: ``rid -> "kv_bytes tokens started
                               lease_exp"``
``P:{T}:top``          zset    ``sid`` scored by its KV bytes in flight (only sessions with > 0)
``P:{T}:leases``       zset    ``"<sid> <rid>"`` scored by lease expiry, for the sweep
``P:{T}:throttled``    zset    ``sid`` scored by throttle expiry
``P:{T}:t``            hash    the tenant's state: the session fields, plus running sums ``n``
                               (reservations), ``ib`` (KV bytes), ``sb`` (sum of kv_bytes x
                               started) and ``ml`` (latest lease expiry while ``n`` > 0)
``P:{T}:tr``           hash    the tenant's reservations: ``rid -> "kv_bytes tokens started
                               lease_exp"`` (every session's)
``P:{T}:tl``           zset    ``rid`` scored by lease expiry: the tenant's reaping index
=====================  ======  ==================================================================

Invariants every script keeps (each script is one atomic unit, so they hold between scripts):

1. ``top[sid]`` = sum of ``kv_bytes`` over ``r:<sid>``, and is absent when that sum is 0; a
   session's in-flight bytes and count are derived from ``r:<sid>`` at every call; a tenant's
   ``n``, ``ib``, ``sb`` change only with ``tr``, in the same script, and are reset to 0 when
   ``n`` reaches 0, so they cannot drift.
2. each entry of ``r:<sid>`` has exactly one ``leases`` member, each entry of ``tr`` one ``tl``
   member, with its lease expiry as score.
3. ``throttled[sid]`` exists iff ``s:<sid>`` has a throttle, with the same expiry.
4. every bucket level is at most its capacity; ``rq`` and ``tk`` are >= 0; ``bs`` >= -capacity.
5. an account (session or tenant) with nothing in flight, no throttle, full buckets and no hold
   history has no keys at all; any other's state carries ``x``, the clock time at which it will
   equal a fresh one (a pure function of the state, so reads never extend it: it counts the
   refill after a dead holder's charge, the throttle's expiry, each bucket's refill, and
   ``ew_at + MIN_TTL`` for the hold EWMA), and state read after ``x`` is treated as fresh. Its
   keys get a TTL of ``max(x - now, MIN_TTL) + 1 s`` (real time; ``MIN_TTL`` absorbs clock skew),
   so abandoned state is collected even if no script touches it again.

Lazily maintained: expired leases and throttles of a session are removed by the next script that
opens it; the store's top-K and throttled-list reads first sweep the sessions that ``leases`` and
``throttled`` show expired (at most ``SWEEP_LIMIT`` per read), one ``USAGE`` call each. A tenant
reaps its own expired leases (from ``tl``) every time it is opened.

Times come from the caller (``ARGV[1]``, the gateway's wall clock), not ``TIME``: the tests drive a
manual clock, and gateways are expected to run NTP; a skew of ``d`` seconds between gateways only
shifts refills and lease expiries by ``d``. Numbers leave Lua as strings (``%.17g``) because Redis
truncates Lua numbers in replies to integers. Cost: O(reservations in flight of the session +
log of the tenant's) per call, plus O(log n) sorted-set updates.
"""

from __future__ import annotations

PRELUDE = r"""
local NOW = tonumber(ARGV[1])
local MIN_TTL = tonumber(ARGV[2])
local BUCKETS = {'bs', 'rq', 'tk'}
local EWMA_W = 0.2

local function fmt(x) return string.format('%.17g', x) end
local function num(v, d)
  if v == nil or v == false then return d end
  return tonumber(v)
end
local function parse(v)
  local b, t, s0, e = string.match(v, '^(%S+) (%S+) (%S+) (%S+)$')
  return tonumber(b), tonumber(t), tonumber(s0), tonumber(e)
end
local function held(b, t, s0, e) return fmt(b) .. ' ' .. fmt(t) .. ' ' .. fmt(s0) .. ' ' .. fmt(e) end

-- the session account of KEYS[i .. i+4] and the tenant account of KEYS[i .. i+2]
local function session_account(i, sid)
  return {tenant = false, s = KEYS[i], r = KEYS[i + 1], top = KEYS[i + 2],
          leases = KEYS[i + 3], throttled = KEYS[i + 4], sid = sid}
end
local function tenant_account(i)
  return {tenant = true, s = KEYS[i], r = KEYS[i + 1], tl = KEYS[i + 2], sid = ''}
end
-- the account of a single-account script: the tenant's when sid is ''
local function account(sid)
  if sid == '' then return tenant_account(1) end
  return session_account(1, sid)
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

-- a tenant's running sums, as MemoryBudgetStore's _Tenant.add / remove
local function t_add(a, st, rid, b, t, e)
  st.n = st.n + 1
  st.ib = st.ib + b
  st.sb = st.sb + b * NOW
  st.ml = math.max(st.ml, e)
  redis.call('HSET', a.r, rid, held(b, t, NOW, e))
  redis.call('ZADD', a.tl, e, rid)
end
local function t_remove(a, st, rid, b, s0)
  redis.call('HDEL', a.r, rid)
  redis.call('ZREM', a.tl, rid)
  st.n = st.n - 1
  st.ib = st.ib - b
  st.sb = st.sb - b * s0
  if st.n <= 0 then st.n = 0; st.ib = 0; st.sb = 0; st.ml = 0 end
end

-- open: load, expire the throttle, reap expired leases, refill to NOW.
local function open(a)
  local flat = redis.call('HGETALL', a.s)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  if h.x and tonumber(h.x) <= NOW then
    -- expired state is fresh: every lease in it was charged and refilled by now
    if a.tenant then
      redis.call('DEL', a.r, a.tl)
    else
      for _, rid in ipairs(redis.call('HKEYS', a.r)) do
        redis.call('ZREM', a.leases, a.sid .. ' ' .. rid)
      end
      redis.call('DEL', a.r)
      redis.call('ZREM', a.throttled, a.sid)
    end
    h = {}
  end
  local st = {
    ts = num(h.ts, NOW), ew = num(h.ew, -1), ew_at = num(h.ew_at, 0),
    th = h.th, th_e = num(h.th_e, 0), th_m = num(h.th_m, -1), th_f = num(h.th_f, 1),
    th_why = h.th_why or '', th_at = num(h.th_at, 0),
    n = num(h.n, 0), ib = num(h.ib, 0), sb = num(h.sb, 0), ml = num(h.ml, 0),
  }
  for _, b in ipairs(BUCKETS) do
    local cap = num(h[b .. '_c'], -1)
    st[b .. '_c'] = cap
    st[b .. '_r'] = num(h[b .. '_r'], 0)
    st[b] = num(h[b], cap)
  end
  if st.th and st.th_e <= NOW then
    st.th = nil
    if not a.tenant then redis.call('ZREM', a.throttled, a.sid) end
  end
  if st.ew >= 0 and st.ew_at + MIN_TTL <= NOW then st.ew = -1 end
  local live = {}
  if a.tenant then
    local exp = redis.call('ZRANGEBYSCORE', a.tl, '-inf', NOW, 'WITHSCORES')
    for i = 1, #exp, 2 do
      local rid, e = exp[i], tonumber(exp[i + 1])
      local v = redis.call('HGET', a.r, rid)
      if v then
        -- charged as released when its lease ran out, with the refill before and after
        local b, _, s0 = parse(v)
        advance(st, e)
        t_remove(a, st, rid, b, s0)
        charge(st, b * (e - s0))
      else
        redis.call('ZREM', a.tl, rid)
      end
    end
  else
    local expired = {}
    local rflat = redis.call('HGETALL', a.r)
    for i = 1, #rflat, 2 do
      local b, t, s0, e = parse(rflat[i + 1])
      local r = {id = rflat[i], b = b, t = t, s = s0, e = e}
      if r.e <= NOW then expired[#expired + 1] = r else live[#live + 1] = r end
    end
    table.sort(expired, function(x, y) return x.e < y.e or (x.e == y.e and x.id < y.id) end)
    for _, r in ipairs(expired) do
      advance(st, r.e)
      redis.call('HDEL', a.r, r.id)
      redis.call('ZREM', a.leases, a.sid .. ' ' .. r.id)
      charge(st, r.b * (r.e - r.s))
    end
  end
  advance(st, NOW)
  st.live = live
  return st
end

local function inflight_bytes(a, st)
  if a.tenant then return st.ib end
  local ib = 0
  for _, r in ipairs(st.live) do ib = ib + r.b end
  return ib
end

local function inflight_count(a, st)
  if a.tenant then return st.n end
  return #st.live
end

local function accrued(a, st)
  if a.tenant then return math.max(0, st.ib * NOW - st.sb) end
  local acc = 0
  for _, r in ipairs(st.live) do acc = acc + r.b * math.max(0, NOW - r.s) end
  return acc
end

-- every reservation of the account (a tenant's are read only when a limit refuses)
local function all_held(a, st)
  if not a.tenant then return st.live end
  local out = {}
  local rflat = redis.call('HGETALL', a.r)
  for i = 1, #rflat, 2 do
    local b, t, s0, e = parse(rflat[i + 1])
    out[#out + 1] = {id = rflat[i], b = b, t = t, s = s0, e = e}
  end
  return out
end

-- commit: top index, fresh-state deletion, write-back with a TTL. Returns true if kept.
local function commit(a, st)
  local ib, cnt, maxe = 0, 0, 0
  if a.tenant then
    ib, cnt, maxe = st.ib, st.n, st.ml
  else
    for _, r in ipairs(st.live) do
      ib = ib + r.b
      cnt = cnt + 1
      if r.e > maxe then maxe = r.e end
    end
    if ib > 0 then redis.call('ZADD', a.top, ib, a.sid) else redis.call('ZREM', a.top, a.sid) end
    if not st.th then redis.call('ZREM', a.throttled, a.sid) end
  end
  -- x: when this state will equal a fresh one, a pure function of the state (reads never
  -- extend it); the same expression, in the same order, as MemoryBudgetStore's keep_until
  local keep, differs = NOW, false
  if cnt > 0 then
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
  redis.call('DEL', a.s)
  if not differs then
    redis.call('DEL', a.r)
    if a.tenant then redis.call('DEL', a.tl) end
    return false
  end
  local f = {'ts', fmt(st.ts), 'x', fmt(keep)}
  if a.tenant then
    for _, kv in ipairs({{'n', st.n}, {'ib', st.ib}, {'sb', st.sb}, {'ml', st.ml}}) do
      f[#f + 1] = kv[1]; f[#f + 1] = fmt(kv[2])
    end
  end
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
  redis.call('HSET', a.s, unpack(f))
  -- the key TTL only collects garbage (real time); MIN_TTL absorbs clock skew between gateways
  local ttl_ms = math.ceil((math.max(keep - NOW, MIN_TTL) + 1) * 1000)
  redis.call('PEXPIRE', a.s, ttl_ms)
  if cnt > 0 then
    redis.call('PEXPIRE', a.r, ttl_ms)
    if a.tenant then redis.call('PEXPIRE', a.tl, ttl_ms) end
  end
  return true
end

local function usage_row(a, st)
  local function opt(cap, v) if cap < 0 then return '' end return fmt(v) end
  return {
    a.sid, fmt(inflight_bytes(a, st)), fmt(inflight_count(a, st)),
    opt(st.bs_c, st.bs - accrued(a, st)), opt(st.bs_c, st.bs_c),
    opt(st.rq_c, st.rq), opt(st.rq_c, st.rq_c),
    opt(st.tk_c, st.tk), opt(st.tk_c, st.tk_c),
    opt(st.ew, st.ew),
    st.th or '', fmt(st.th_e), fmt(st.th_m), fmt(st.th_f), st.th_why, fmt(st.th_at),
  }
end

-- settle: release rid from the account; true when it was held
local function settle(a, st, rid, actual)
  local b, t, s0
  if a.tenant then
    local v = redis.call('HGET', a.r, rid)
    if not v then return false end
    b, t, s0 = parse(v)
    t_remove(a, st, rid, b, s0)
  else
    local found = nil
    for i, r in ipairs(st.live) do
      if r.id == rid then found = i; b, t, s0 = r.b, r.t, r.s; break end
    end
    if not found then return false end
    table.remove(st.live, found)
    redis.call('HDEL', a.r, rid)
    redis.call('ZREM', a.leases, a.sid .. ' ' .. rid)
  end
  local hold = math.max(0, NOW - s0)
  charge(st, b * hold)
  if st.ew < 0 then st.ew = hold else st.ew = (1 - EWMA_W) * st.ew + EWMA_W * hold end
  st.ew_at = NOW
  if st.tk_c >= 0 and actual >= 0 and actual < t then
    st.tk = math.min(st.tk_c, st.tk + (t - actual))
  end
  return true
end
"""

# KEYS: the session's s, r, top, leases, throttled; the tenant's t, tr, tl
# ARGV: now, min_ttl, sid, rid, lease_ttl, kv_bytes, tokens, window_s, then the session's and
#       the tenant's limits, five each: inflight_kv_bytes, inflight_requests, kv_byte_seconds,
#       rpm, tpm  (-1: unlimited)
# -> {1, lease_expires_at} | {0, limit, retry_after (-1: never), throttle state or '', level}
RESERVE = (
    PRELUDE
    + r"""
local sid, rid = ARGV[3], ARGV[4]
local lease_ttl, bytes, tokens = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local window = tonumber(ARGV[8])
local sa, ta = session_account(1, sid), tenant_account(6)
local tst = open(ta)
local sst = open(sa)
local function done(out)
  commit(sa, sst)
  commit(ta, tst)
  return out
end
for _, r in ipairs(sst.live) do
  if r.id == rid then return done({1, fmt(r.e)}) end
end
for _, lv in ipairs({{'tenant', tst}, {'session', sst}}) do
  if lv[2].th == 'blocked' then
    return done({0, 'blocked', fmt(lv[2].th_e - NOW), 'blocked', lv[1]})
  end
end

-- apply the account's throttle to its limits (ARGV[i .. i+4]); set its buckets' capacities
local function prepare(st, i)
  local max_b, max_n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local caps = {bs = tonumber(ARGV[i + 2]), rq = tonumber(ARGV[i + 3]), tk = tonumber(ARGV[i + 4])}
  local periods = {bs = window, rq = 60, tk = 60}
  if st.th then
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
  return {max_b = max_b, max_n = max_n}
end

-- the first limit of the account this reservation fails, and the wait estimate
local function refusal(a, st, c)
  local function slot_wait(free_n, free_b)
    local rs = all_held(a, st)
    table.sort(rs, function(x, y) return x.s < y.s or (x.s == y.s and x.id < y.id) end)
    local fn, fb = 0, 0
    local ew = math.max(st.ew, 0)
    for _, r in ipairs(rs) do
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
  local count, ib = inflight_count(a, st), inflight_bytes(a, st)
  local limit, wait = nil, 0
  if c.max_n >= 0 and count + 1 > c.max_n then
    limit = 'inflight_requests'; wait = slot_wait(count + 1 - c.max_n, 0)
  elseif c.max_b >= 0 and ib + bytes > c.max_b then
    limit = 'inflight_kv_bytes'; wait = slot_wait(0, ib + bytes - c.max_b)
  elseif st.bs_c >= 0 and st.bs - accrued(a, st) <= 0 then
    limit = 'kv_byte_seconds'; wait = bucket_wait('bs', accrued(a, st))
  elseif st.rq_c >= 0 and st.rq < 1 then
    limit = 'requests_per_minute'; wait = bucket_wait('rq', 1)
  elseif st.tk_c >= 0 and st.tk < tokens then
    limit = 'tokens_per_minute'; wait = bucket_wait('tk', tokens)
  end
  if limit and st.th then
    local left = st.th_e - NOW
    if wait < 0 then wait = left else wait = math.min(wait, left) end
  end
  return limit, wait
end

local sc = prepare(sst, 9)
local tc = prepare(tst, 14)
for _, lv in ipairs({{'session', sa, sst, sc}, {'tenant', ta, tst, tc}}) do
  local limit, wait = refusal(lv[2], lv[3], lv[4])
  if limit then return done({0, limit, fmt(wait), lv[3].th or '', lv[1]}) end
end
local e = NOW + lease_ttl
redis.call('HSET', sa.r, rid, held(bytes, tokens, NOW, e))
redis.call('ZADD', sa.leases, e, sid .. ' ' .. rid)
sst.live[#sst.live + 1] = {id = rid, b = bytes, t = tokens, s = NOW, e = e}
t_add(ta, tst, rid, bytes, tokens, e)
for _, st in ipairs({sst, tst}) do
  if st.rq_c >= 0 then st.rq = st.rq - 1 end
  if st.tk_c >= 0 then st.tk = st.tk - tokens end
end
return done({1, fmt(e)})
"""
)

# KEYS: as RESERVE. ARGV: now, min_ttl, sid, rid, actual_tokens (-1: unknown)
# -> 1 released | 0 not held
RELEASE = (
    PRELUDE
    + r"""
local sid, rid, actual = ARGV[3], ARGV[4], tonumber(ARGV[5])
local sa, ta = session_account(1, sid), tenant_account(6)
local found = 0
if redis.call('EXISTS', sa.s) == 1 or redis.call('EXISTS', sa.r) == 1 then
  local st = open(sa)
  if settle(sa, st, rid, actual) then found = 1 end
  commit(sa, st)
end
if redis.call('EXISTS', ta.s) == 1 then
  local st = open(ta)
  settle(ta, st, rid, actual)
  commit(ta, st)
end
return found
"""
)

# KEYS: as RESERVE. ARGV: now, min_ttl, sid, rid, lease_ttl -> new expiry | false when not held
RENEW = (
    PRELUDE
    + r"""
local sid, rid, lease_ttl = ARGV[3], ARGV[4], tonumber(ARGV[5])
local sa, ta = session_account(1, sid), tenant_account(6)
if redis.call('EXISTS', sa.s) == 0 and redis.call('EXISTS', sa.r) == 0 then return false end
local st = open(sa)
local e = NOW + lease_ttl
local out = false
for _, r in ipairs(st.live) do
  if r.id == rid then
    r.e = e
    redis.call('HSET', sa.r, rid, held(r.b, r.t, r.s, e))
    redis.call('ZADD', sa.leases, e, sid .. ' ' .. rid)
    out = fmt(e)
    break
  end
end
commit(sa, st)
if out then
  local tst = open(ta)
  local v = redis.call('HGET', ta.r, rid)
  if v then
    local b, t, s0 = parse(v)
    redis.call('HSET', ta.r, rid, held(b, t, s0, e))
    redis.call('ZADD', ta.tl, e, rid)
    tst.ml = math.max(tst.ml, e)
  end
  commit(ta, tst)
end
return out
"""
)

# KEYS: as RESERVE. ARGV: now, min_ttl, sid, rid, kv_bytes
# -> the KV bytes the reservation holds after the call | false when not held
# A partial release (MemoryBudgetStore's _shrink): never raises the bytes; the bytes shed are
# charged for the time they were held; the tenant's running sums change in the same step.
SHRINK = (
    PRELUDE
    + r"""
local sid, rid, to = ARGV[3], ARGV[4], tonumber(ARGV[5])
local sa, ta = session_account(1, sid), tenant_account(6)
if redis.call('EXISTS', sa.s) == 0 and redis.call('EXISTS', sa.r) == 0 then return false end
local st = open(sa)
local out = false
for _, r in ipairs(st.live) do
  if r.id == rid then
    if r.b > to then
      charge(st, (r.b - to) * math.max(0, NOW - r.s))
      r.b = to
      redis.call('HSET', sa.r, rid, held(r.b, r.t, r.s, r.e))
    end
    out = fmt(r.b)
    break
  end
end
commit(sa, st)
if out then
  local tst = open(ta)
  local v = redis.call('HGET', ta.r, rid)
  if v then
    local b, t, s0, e = parse(v)
    if b > to then
      local shed = b - to
      charge(tst, shed * math.max(0, NOW - s0))
      tst.ib = tst.ib - shed
      tst.sb = tst.sb - shed * s0
      redis.call('HSET', ta.r, rid, held(to, t, s0, e))
    end
  end
  commit(ta, tst)
end
return out
"""
)

# KEYS: the session's s, r, top, leases, throttled (sid given) or the tenant's t, tr, tl (sid '')
# ARGV: now, min_ttl, sid, state, expires_at, max_inflight (-1: none), factor, reason, set_at
SET_THROTTLE = (
    PRELUDE
    + r"""
local a = account(ARGV[3])
local st = open(a)
local exp = tonumber(ARGV[5])
if exp > NOW then
  st.th = ARGV[4]; st.th_e = exp; st.th_m = tonumber(ARGV[6]); st.th_f = tonumber(ARGV[7])
  st.th_why = ARGV[8]; st.th_at = tonumber(ARGV[9])
  if not a.tenant then redis.call('ZADD', a.throttled, exp, a.sid) end
else
  st.th = nil
end
commit(a, st)
return 1
"""
)

# KEYS: as SET_THROTTLE. ARGV: now, min_ttl, sid -> 1 when a throttle was removed, else 0
CLEAR_THROTTLE = (
    PRELUDE
    + r"""
local a = account(ARGV[3])
if redis.call('EXISTS', a.s) == 0 then return 0 end
local st = open(a)
local had = 0
if st.th then had = 1 end
st.th = nil
commit(a, st)
return had
"""
)

# KEYS: as SET_THROTTLE. ARGV: now, min_ttl, sid, then any expired ``leases`` members of this
# session to drop (the sweep's) -> usage row | false for a fresh account
USAGE = (
    PRELUDE
    + r"""
local a = account(ARGV[3])
if not a.tenant then
  for i = 4, #ARGV do redis.call('ZREM', a.leases, ARGV[i]) end
end
if redis.call('EXISTS', a.s) == 0 and redis.call('EXISTS', a.r) == 0 then
  if not a.tenant then
    -- collected by its key TTL: nothing of it may stay in the indexes
    redis.call('ZREM', a.top, a.sid)
    redis.call('ZREM', a.throttled, a.sid)
  end
  return false
end
local st = open(a)
if not commit(a, st) then return false end
return usage_row(a, st)
"""
)
