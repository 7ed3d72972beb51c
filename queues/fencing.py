"""Fenced writes: Lua scripts that write a request's output, acknowledge, requeue or dead-letter its
entry only while the writer holds the request's newest fencing token (``Keys.fence``).

Each delivery of an intake entry (a read by XREADGROUP, a take-over by XCLAIM) gives the request a
new, higher token: the first delivery of an entry the API appended takes the token drawn with it
(INTAKE), any other draws the next one (FENCE). A former owner that is slow but alive (a long pause, a
partition) keeps its older token: everything it writes afterwards is refused inside Redis, in the same
step as the check, so it can neither add to the client's stream nor acknowledge the entry its successor
is running. Token 0 means unfenced (a writer outside any delivery, such as a test standing in for a dead worker).
"""

from __future__ import annotations

# Writes a batch of events of several requests. KEYS: fence_1, out_1, stream_1, fence_2, ...
# ARGV: ttl_s, n_requests, group, then per request: token, channel, entry id to acknowledge ('' for
# none), n_events, (seq, payload) * n_events. Returns the indices (1-based) of the fenced requests.
# Durable copy first, then one PUBLISH per channel with the events of the requests that were not
# fenced, as a JSON list. A request that ends in this batch has its intake entry acknowledged and
# deleted, and its token dropped, in the same step as its final event is written (as ACK below).
WRITE_EVENTS = """
local ttl = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local group = ARGV[3]
local pos = 4
local fenced = {}
local channels = {}
local order = {}
for i = 1, n do
  local fence_key, out_key, stream = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token, channel, ack_id, count = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  pos = pos + 4
  if token ~= '0' and redis.call('GET', fence_key) ~= token then
    fenced[#fenced + 1] = i
    pos = pos + 2 * count
  else
    local live = channels[channel]
    if live == nil then
      live = {}
      channels[channel] = live
      order[#order + 1] = channel
    end
    for _ = 1, count do
      -- A position already written (a re-run after redelivery) is refused by XADD: de-duplication.
      redis.pcall('XADD', out_key, '0-' .. ARGV[pos], 'e', ARGV[pos + 1])
      live[#live + 1] = ARGV[pos + 1]
      pos = pos + 2
    end
    redis.call('EXPIRE', out_key, ttl)
    if ack_id ~= '' then
      redis.call('XACK', stream, group, ack_id)
      redis.call('XDEL', stream, ack_id)
      redis.call('DEL', fence_key)
    end
  end
end
for _, channel in ipairs(order) do
  local live = channels[channel]
  if #live > 0 then
    redis.call('PUBLISH', channel, '[' .. table.concat(live, ',') .. ']')
  end
end
return fenced
"""

# Appends a request's intake entry with the token of its first delivery. KEYS: fence, stream. ARGV: the
# token's ttl in seconds, the entry's field and value pairs. The token is drawn here, above every earlier
# owner's, and stored with the entry (``INTAKE_FENCE_FIELD``): the worker that reads the entry fresh holds
# it at once, without a round trip of its own before the request's first token; any later delivery (a
# take-over) draws the next one with FENCE. Returns the entry id.
INTAKE = """
local token = redis.call('INCRBY', KEYS[1], 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('XADD', KEYS[2], '*', 'f', token, unpack(ARGV, 2))
"""
# The intake entry's field that holds its first delivery's token (INTAKE's 'f').
INTAKE_FENCE_FIELD = b"f"

# Gives each delivered entry its request's next token and tells whether a cancel tombstone names the
# request. KEYS: fence_1, cancelled_1, fence_2, ... ARGV: the tokens' ttl in seconds. Returns token_1,
# cancelled_1 (0 or 1), token_2, ...
FENCE = """
local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = redis.call('INCRBY', KEYS[i], 1)
  redis.call('EXPIRE', KEYS[i], ARGV[1])
  out[#out + 1] = redis.call('EXISTS', KEYS[i + 1])
end
return out
"""

# Acknowledges and deletes a finished entry, and drops its token. KEYS: fence, stream.
# ARGV: token, group, entry id. Returns 1, or 0 when fenced.
ACK = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[1])
return 1
"""

# Replaces an entry by its continuation at the end of a stream. KEYS: fence, old stream, new stream.
# ARGV: token, group, entry id, message field, message, tokens field, tokens. Returns the new entry id,
# or false when fenced.
REQUEUE = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local id = redis.call('XADD', KEYS[3], '*', ARGV[4], ARGV[5], ARGV[6], ARGV[7])
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return id
"""

# Moves an entry to the dead-letter stream with its reason. KEYS: fence, stream, dead-letter stream.
# ARGV: token, group, entry id, reason, message field, message, dlq max length. Returns 1, or 0 when fenced.
# The token stays (until it expires): an operator may replay the entry (``queues.dlq``), and its next
# delivery must draw a token above every earlier owner's.
DEAD_LETTER = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'reason', ARGV[4], 'stream', KEYS[2], ARGV[5], ARGV[6])
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return 1
"""

# Resets the idle time of the entries the caller still owns. KEYS: fence_1, stream_1, ...
# ARGV: group, consumer, then per entry: token, entry id. Returns the indices of fenced entries: those
# whose token is another's. An entry whose token is gone was acknowledged, its request finished — most
# often by the caller itself, a moment before it let the entry go — and is neither kept nor fenced: a
# former owner is refused at its next write (one that still held it waiting runs it until then).
KEEP_CLAIMED = """
local fenced = {}
for i = 1, #KEYS / 2 do
  local token, id = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local current = token ~= '0' and redis.call('GET', KEYS[2 * i - 1])
  if current and current ~= token then
    fenced[#fenced + 1] = i
  elseif current or token == '0' then
    redis.call('XCLAIM', KEYS[2 * i], ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return fenced
"""
