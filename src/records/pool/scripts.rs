//! Lua run inside Redis, so each step on a pool is one atomic round trip.
//! Every script touches the keys of one sequence period only; they share a
//! hash tag and so one Redis Cluster slot.

/// KEYS: lock, pool, meta. ARGV: token, ttl_ms.
/// Takes the refill lock and, only if it was free, reports depth, target and
/// the time of the last refill (ms) for the double check.
pub const ACQUIRE: &str = r#"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local depth = redis.call('LLEN', KEYS[2])
local meta = redis.call('HMGET', KEYS[3], 'target', 'refilled_at')
return {depth, tonumber(meta[1] or '0') or 0, tonumber(meta[2] or '0') or 0}
"#;

/// KEYS: lock, pool, meta. ARGV: token, first, end (exclusive), target,
/// now_ms, last ('1' for the last part of a block).
/// Appends part of a block only while the caller still holds the lock (a
/// refill that outlived its lock must not push numbers behind a newer
/// block), stamps the server's run_id so a pool replayed by another server
/// is recognised, and keeps the highest block end ever pushed (`max_end`:
/// Postgres must never be found behind it). A block goes in parts so that no
/// one script holds Redis, which serves every tenant, for long; the last
/// part records the target and releases the lock. Returns the new depth, or
/// -1 if the lock was lost.
pub const PUSH: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local first, last = tonumber(ARGV[2]), tonumber(ARGV[3]) - 1
local chunk, n = {}, 0
for i = first, last do
  n = n + 1
  chunk[n] = string.format('%d', i)
  if n == 4000 then
    redis.call('RPUSH', KEYS[2], unpack(chunk))
    chunk, n = {}, 0
  end
end
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(chunk)) end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
local max_end = tonumber(redis.call('HGET', KEYS[3], 'max_end') or '0') or 0
if tonumber(ARGV[3]) > max_end then max_end = tonumber(ARGV[3]) end
redis.call('HSET', KEYS[3], 'run_id', run_id, 'max_end', string.format('%d', max_end))
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[3], 'target', ARGV[4], 'refilled_at', ARGV[5])
  redis.call('DEL', KEYS[1])
end
return redis.call('LLEN', KEYS[2])
"#;

/// KEYS: lock. ARGV: token. Compare-and-delete: never frees another holder's lock.
pub const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// Lua that turns `values` (ascending or descending numbers as strings)
/// into flat [first, last] pairs of consecutive runs, in `out` from `n`.
macro_rules! runs_lua {
    () => {
        r#"
local function runs(values, descending)
  local out, n, first, prev = {}, 0, nil, nil
  local step = 1
  if descending then step = -1 end
  for _, v in ipairs(values) do
    local x = tonumber(v)
    if x then
      if prev and x == prev + step then
        prev = x
      else
        if first then
          out[n + 1] = string.format('%d', math.min(first, prev))
          out[n + 2] = string.format('%d', math.max(first, prev))
          n = n + 2
        end
        first, prev = x, x
      end
    end
  end
  if first then
    out[n + 1] = string.format('%d', math.min(first, prev))
    out[n + 2] = string.format('%d', math.max(first, prev))
  end
  return out
end
"#
    };
}

/// Lua that merges `back` (numbers, any order) into the ascending list
/// `key` at its head; returns the list's length (see [`GIVE_BACK`]).
macro_rules! give_back_lua {
    () => {
        r#"
local function give_back(key, back)
  table.sort(back)
  local top = back[#back]
  local lower = {}
  while true do
    local head = redis.call('LINDEX', key, 0)
    if not head or tonumber(head) > top then break end
    lower[#lower + 1] = tonumber(redis.call('LPOP', key))
  end
  -- Both ascending: merged, then pushed highest first so the lowest ends
  -- at the head; a number in both (a repeated give-back) goes in once.
  local merged, i, j = {}, 1, 1
  while i <= #back or j <= #lower do
    local v
    if j > #lower or (i <= #back and back[i] <= lower[j]) then
      v = back[i]; i = i + 1
    else
      v = lower[j]; j = j + 1
    end
    if merged[#merged] ~= v then merged[#merged + 1] = v end
  end
  local chunk, n = {}, 0
  for k = #merged, 1, -1 do
    n = n + 1
    chunk[n] = string.format('%d', merged[k])
    if n == 4000 then
      redis.call('LPUSH', key, unpack(chunk))
      chunk, n = {}, 0
    end
  end
  if n > 0 then redis.call('LPUSH', key, unpack(chunk)) end
  return redis.call('LLEN', key)
end
"#
    };
}

/// KEYS: pool, meta, inflight. ARGV: count, token, deadline (ms on the
/// server's clock, 0 for none), then tokens of earlier pops whose answers
/// arrived (forgotten here).
/// Pops up to `count` numbers and reports what is left, the pool's target,
/// the server's time (ms) and whether the pop came too late (1). A pop
/// the server runs after its caller gave up takes nothing: past its
/// deadline, or after its caller cancelled its token (see [`RESOLVE_POP`]).
/// What a pop takes is kept under its token in `inflight` until its caller
/// says it got the answer, so a pop whose answer was lost with its
/// connection is found and given back.
pub const POP: &str = concat!(
    runs_lua!(),
    r#"
local inflight = KEYS[3]
for i = 4, #ARGV do redis.call('HDEL', inflight, ARGV[i]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local target = tonumber(redis.call('HGET', KEYS[2], 'target') or '0') or 0
local deadline = tonumber(ARGV[3])
if redis.call('HDEL', inflight, ARGV[2]) == 1 or (deadline > 0 and now > deadline) then
  return {{}, redis.call('LLEN', KEYS[1]), target, now, 1}
end
local popped = redis.call('LPOP', KEYS[1], ARGV[1])
if not popped then popped = {} end
if #popped > 0 then
  redis.call('HSET', inflight, ARGV[2], table.concat(runs(popped, false), ','))
  redis.call('PEXPIRE', inflight, 3600000)
end
return {popped, redis.call('LLEN', KEYS[1]), target, now, 0}
"#
);

/// KEYS: pool, inflight. ARGV: token.
/// Settles a pop whose caller got no answer (a timeout, a lost
/// connection): if it ran, its numbers (which nobody received) go back to
/// the head of the pool, merged as by [`GIVE_BACK`]; if not, its token is
/// cancelled so that, run later, it takes nothing. Returns how many
/// numbers went back.
pub const RESOLVE_POP: &str = concat!(
    give_back_lua!(),
    r#"
local entry = redis.call('HGET', KEYS[2], ARGV[1])
if not entry then
  redis.call('HSET', KEYS[2], ARGV[1], 'cancelled')
  redis.call('PEXPIRE', KEYS[2], 3600000)
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
if entry == 'cancelled' then return 0 end
local bounds = {}
for v in string.gmatch(entry, '[^,]+') do bounds[#bounds + 1] = tonumber(v) end
local back = {}
for i = 1, #bounds - 1, 2 do
  for n = bounds[i], bounds[i + 1] do back[#back + 1] = n end
end
if #back == 0 then return 0 end
give_back(KEYS[1], back)
return #back
"#
);

/// The server's time in ms.
pub const CLOCK: &str = r#"
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"#;

/// KEYS: pool, meta, drain. ARGV: 'foreign' (empty the pool unless this
/// very server filled it) or 'all'.
/// Empties the pool in one step by renaming its list to `drain` (which
/// expires within the hour should its drainer die); returns 1 if there was a
/// list to drain. The server is the one holding the pool: in a cluster each
/// pool is judged by its own node, so one node's restart costs only its
/// pools.
pub const DISCARD: &str = r#"
if ARGV[1] == 'foreign' then
  local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
  if redis.call('HGET', KEYS[2], 'run_id') == run_id then return 0 end
end
redis.call('HDEL', KEYS[2], 'run_id')
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[3])
redis.call('PEXPIRE', KEYS[3], 3600000)
return 1
"#;

/// KEYS: drain. ARGV: part.
/// Takes up to `part` numbers off a drained pool; returns what is left and
/// the numbers taken as flat [first, last] pairs of consecutive runs.
pub const DRAIN: &str = concat!(
    runs_lua!(),
    r#"
local part = tonumber(ARGV[1])
local values = redis.call('LRANGE', KEYS[1], 0, part - 1)
redis.call('LTRIM', KEYS[1], part, -1)
return {redis.call('LLEN', KEYS[1]), runs(values, false)}
"#
);

/// KEYS: installation. ARGV: our installation id.
/// Claims the key prefix for one database; returns the id that owns it.
pub const CLAIM_PREFIX: &str = r#"
local owner = redis.call('GET', KEYS[1]) or ARGV[1]
if owner == ARGV[1] then
  -- Written every time: a server that takes no writes (a replica, a
  -- demoted master) refuses here, before any pool is used on it.
  redis.call('SET', KEYS[1], owner)
end
return owner
"#;

/// KEYS: pool, inflight. ARGV: token, then the numbers to give back.
/// Puts numbers back keeping the pool ascending, so its head stays its
/// lowest number (what requests take next, and the bound below which
/// reconciliation judges): the pool's numbers lower than the highest one
/// given back come off its head and go back merged with them. Those are
/// only numbers given back earlier (a pool's numbers above a leased one
/// were all there when it was leased, and refills go to the tail), so few.
/// Once per token (kept an hour): a give-back whose answer was lost is
/// tried again with its token, and whichever of the two runs second puts
/// nothing back. Run twice, it put back numbers requests had taken since
/// the first (a review saw 46 and 47 answered, then back in their pool).
/// Returns the pool's depth.
pub const GIVE_BACK: &str = concat!(
    give_back_lua!(),
    r#"
local first = redis.call('HSETNX', KEYS[2], 'back:' .. ARGV[1], '1')
redis.call('PEXPIRE', KEYS[2], 3600000)
if first == 0 then return redis.call('LLEN', KEYS[1]) end
local back = {}
for i = 2, #ARGV do back[i - 1] = tonumber(ARGV[i]) end
return give_back(KEYS[1], back)
"#
);

/// KEYS: pool. ARGV: max, part.
/// Removes up to `part` numbers above `max` from the tail of the ascending
/// pool; returns whether more may be left (1) and the numbers removed as
/// flat [first, last] pairs of consecutive runs.
pub const TRIM_ABOVE: &str = concat!(
    runs_lua!(),
    r#"
local max, part = tonumber(ARGV[1]), tonumber(ARGV[2])
-- The tail read in one call and cut in one: a number at a time (LINDEX
-- and RPOP each) held Redis over 50 ms for a part.
local tail = redis.call('LRANGE', KEYS[1], -part, -1)
local removed = {}
for i = #tail, 1, -1 do
  local n = tonumber(tail[i])
  if n <= max then break end
  removed[#removed + 1] = n
end
if #removed > 0 then redis.call('LTRIM', KEYS[1], 0, -#removed - 1) end
if #removed == part then return {1, runs(removed, true)} end
return {0, runs(removed, true)}
"#
);
