"""The Lua scripts ``RedisStorageQueue`` runs on the stream's node, each one round trip.

Every script that acts on the stream first checks that it is the one this process knew (KEYS[2]
is the meta hash, ARGV[1] the epoch): a stream lost and made anew is never read or written as if
it were the same one.
"""

from __future__ import annotations

from .keys import FIELD, LAYOUT, REFUSED

__all__ = ["SCRIPTS"]

_ALIVE = """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if epoch ~= ARGV[1] then return redis.error_reply('TSLLOST ' .. (epoch and 'renewed' or 'gone')) end
"""

# Make the stream, its epoch and the group (first use in each process), or check them. ARGV: new
# epoch, group, the epoch this process knew ('' if none). Returns the epoch.
_ENSURE = (
    """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if ARGV[3] ~= '' and epoch ~= ARGV[3] then return redis.error_reply('TSLLOST ' .. (epoch and 'renewed' or 'gone')) end
local exists = redis.call('EXISTS', KEYS[1]) == 1
if not epoch then
  if exists then return redis.error_reply('TSLLAYOUT ' .. redis.call('TYPE', KEYS[1])['ok']) end
  epoch = ARGV[1]
  redis.call('HSET', KEYS[2], 'epoch', epoch, 'layout', '"""
    + LAYOUT
    + """')
elseif not exists then
  return redis.error_reply('TSLLOST stream')
end
local found = false
if exists then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    for i = 1, #g, 2 do if g[i] == 'name' and g[i + 1] == ARGV[2] then found = true end end
  end
end
if not found then
  if ARGV[3] ~= '' then return redis.error_reply('TSLLOST group') end
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[2], '0', 'MKSTREAM')
end
return epoch
"""
)

_PUT = _ALIVE + "return redis.call('XADD', KEYS[1], '*', '" + FIELD + "', ARGV[2])"

_CLOSE = _ALIVE + "return redis.call('HSET', KEYS[2], 'closed', '1')"

_IS_CLOSED = _ALIVE + "return redis.call('HEXISTS', KEYS[2], 'closed')"

# Entries are checked in Redis before they are sent: one that is not exactly one 'h' field of at
# most `limit` bytes comes back as {'!', why}, so a huge entry never crosses the network.
_BOUND = (
    """
local function bound(entries, limit)
  for _, e in ipairs(entries) do
    local f = e[2]
    if type(f) == 'table' then
      if #f ~= 2 or f[1] ~= '"""
    + FIELD
    + """' then
        e[2] = {'"""
    + REFUSED
    + """', 'has ' .. math.floor(#f / 2) .. ' fields, not one """
    + FIELD
    + """ field holding a handle record'}
      elseif string.len(f[2]) > limit then
        e[2] = {'"""
    + REFUSED
    + """', 'holds ' .. string.len(f[2]) .. ' bytes, over the ' .. limit .. ' of a handle record'}
      end
    end
  end
end
"""
)

# Delivery: read undelivered entries, count and bound them, in one round trip (no BLOCK inside a
# script, and no blocking XREADGROUP outside one: it would hand entries over whole, unchecked).
# ARGV[5]: the largest entry sent.
_READ = (
    _ALIVE
    + _BOUND
    + """
local r = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], '>')
if r then
  redis.call('HINCRBY', KEYS[3], ARGV[2] .. ':delivered', #r[1][2])
  bound(r[1][2], tonumber(ARGV[5]))
end
return r
"""
)

# Take over entries idle on any consumer for over ARGV[4] ms; forget consumers with nothing pending.
# ARGV[7]: the largest entry sent.
_CLAIM = (
    _ALIVE
    + _BOUND
    + """
local g = ARGV[2] .. ':'
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], 'COUNT', ARGV[6])
bound(r[2], tonumber(ARGV[7]))
local n, d = #r[2], 0
for _, e in ipairs(r[2]) do
  if redis.call('SADD', KEYS[4], g .. e[1]) == 1 then d = d + 1 end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[3], g .. 'claimed', n)
  redis.call('HINCRBY', KEYS[3], g .. 'delivered', n)
end
if d > 0 then redis.call('HINCRBY', KEYS[3], g .. 'duplicates', d) end
local lost = r[3] and #r[3] or 0
if lost > 0 then redis.call('HINCRBY', KEYS[3], g .. 'lost', lost) end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[2])) do
  local t = {}
  for i = 1, #c, 2 do t[c[i]] = c[i + 1] end
  if t['pending'] == 0 and t['idle'] > tonumber(ARGV[4]) and t['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[2], t['name'])
  end
end
return {r[1], r[2], lost}
"""
)

# Acknowledge; an entry acknowledged before counts once as a duplicate. ARGV[3]: '1' if failed.
_ACK = (
    _ALIVE
    + """
local g = ARGV[2] .. ':'
local acked, dups = 0, 0
for i = 4, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[2], ARGV[i]) == 1 then acked = acked + 1
  elseif redis.call('SADD', KEYS[4], g .. ARGV[i]) == 1 then dups = dups + 1 end
end
if acked > 0 then redis.call('HINCRBY', KEYS[3], g .. 'acked', acked) end
if dups > 0 then redis.call('HINCRBY', KEYS[3], g .. 'duplicates', dups) end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], g .. 'failed', #ARGV - 3) end
return {acked, dups}
"""
)

# Give entries back: each still pending on a consumer of the family ARGV[3] (so not claimed by
# another meanwhile) is acknowledged and its record appended again, undelivered. ARGV[4]: '1' if
# they were read but never handed out (a consumer trusting no root): taken off 'delivered', not
# counted as 'returned'.
_RETURN = (
    _ALIVE
    + """
local n = 0
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[2], ARGV[i], ARGV[i], 1)
  if #p > 0 and string.sub(p[1][2], 1, #ARGV[3]) == ARGV[3] then
    local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    redis.call('XACK', KEYS[1], ARGV[2], ARGV[i])
    if #e > 0 then
      redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
      n = n + 1
    end
  end
end
if n > 0 then
  if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[3], ARGV[2] .. ':delivered', -n)
  else redis.call('HINCRBY', KEYS[3], ARGV[2] .. ':returned', n) end
end
return n
"""
)

# Trim below the oldest entry any group still needs: its oldest pending one, or its first undelivered.
_TRIM = """
local function less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok or #groups == 0 then return 0 end
local keep = nil
for _, g in ipairs(groups) do
  local t = {}
  for i = 1, #g, 2 do t[g[i]] = g[i + 1] end
  local lm, ls = string.match(t['last-delivered-id'], '(%d+)-(%d+)')
  local cand = lm .. '-' .. string.format('%d', tonumber(ls) + 1)
  local p = redis.call('XPENDING', KEYS[1], t['name'])
  if p[1] > 0 and less(p[2], cand) then cand = p[2] end
  if keep == nil or less(cand, keep) then keep = cand end
end
return redis.call('XTRIM', KEYS[1], 'MINID', keep)
"""

_NOW_MS = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# A producer's heartbeat: (re)register ARGV[2] as ARGV[4], alive until now + ARGV[3] ms (server clock).
_BEAT = (
    _ALIVE
    + _NOW_MS
    + """
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[2])
"""
)

# Producers registered with producer() whose heartbeat deadline passed.
_DEAD = (
    _NOW_MS
    + """
local dead = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  local deadline = redis.call('ZSCORE', KEYS[2], id)
  if not deadline or tonumber(deadline) < now then table.insert(dead, id) end
end
return dead
"""
)

# Forget this consumer if nothing is pending on it (pending entries would be dropped with it).
_RETIRE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""

SCRIPTS = {
    "ensure": _ENSURE,
    "put": _PUT,
    "close": _CLOSE,
    "is_closed": _IS_CLOSED,
    "read": _READ,
    "claim": _CLAIM,
    "ack": _ACK,
    "return": _RETURN,
    "trim": _TRIM,
    "beat": _BEAT,
    "dead": _DEAD,
    "retire": _RETIRE,
}
