//! Lua run inside Redis, so each step on a pool is one atomic round trip.
//! Every script touches the keys of one sequence period only; they share a
//! hash tag and so one Redis Cluster slot.
//!
//! A pool's list holds runs of numbers, `first-last` (both included),
//! ascending and disjoint, its head the lowest: a block of a million
//! numbers is one element, so no script's work grows with the numbers a
//! pool holds, only with its runs (one per block pushed, and one per
//! give-back that did not join its neighbours: a few). A bare number (the
//! form of earlier versions, one element per number) reads as a run of
//! one.

/// Lua helpers every pool script shares: a run read from its element and
/// written back, and how many numbers a list holds.
macro_rules! pool_lua {
    () => {
        r#"
local function bounds(s)
  local a, b = string.match(s, '^(%d+)-(%d+)$')
  if a then return tonumber(a), tonumber(b) end
  local n = tonumber(s)
  return n, n
end
local function run(a, b) return string.format('%d-%d', a, b) end
local function depth(key)
  local n = 0
  for _, s in ipairs(redis.call('LRANGE', key, 0, -1)) do
    local a, b = bounds(s)
    if a then n = n + b - a + 1 end
  end
  return n
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function texts(pairs_)
  local out = {}
  for i, v in ipairs(pairs_) do out[i] = string.format('%d', v) end
  return out
end
"#
    };
}

/// Lua that merges runs (`back`, flat first, last pairs, any order) into
/// the ascending list `key` at its head; returns the list's depth (see
/// [`GIVE_BACK`]).
macro_rules! give_back_lua {
    () => {
        r#"
local function give_back(key, back)
  local given = {}
  for i = 1, #back - 1, 2 do given[#given + 1] = {back[i], back[i + 1]} end
  if #given == 0 then return depth(key) end
  table.sort(given, function(x, y) return x[1] < y[1] end)
  local top = 0
  for _, r in ipairs(given) do if r[2] > top then top = r[2] end end
  -- The pool's runs that start at or below the highest number given back
  -- (or just above it) come off the head to be merged: only numbers given
  -- back earlier sit there, so few.
  local lower = {}
  while true do
    local head = redis.call('LINDEX', key, 0)
    if not head then break end
    local a, b = bounds(head)
    if a and a > top + 1 then break end
    redis.call('LPOP', key)
    if a then lower[#lower + 1] = {a, b} end
  end
  -- Both ascending: merged, runs that touch or overlap joined (a number in
  -- both, a repeated give-back, goes in once), then pushed highest first
  -- so the lowest ends at the head.
  local merged, i, j = {}, 1, 1
  local function add(r)
    local m = merged[#merged]
    if m and r[1] <= m[2] + 1 then
      if r[2] > m[2] then m[2] = r[2] end
    else
      merged[#merged + 1] = {r[1], r[2]}
    end
  end
  while i <= #given or j <= #lower do
    if j > #lower or (i <= #given and given[i][1] <= lower[j][1]) then
      add(given[i]); i = i + 1
    else
      add(lower[j]); j = j + 1
    end
  end
  for k = #merged, 1, -1 do redis.call('LPUSH', key, run(merged[k][1], merged[k][2])) end
  return depth(key)
end
"#
    };
}

/// KEYS: lock, pool, meta. ARGV: token, ttl_ms.
/// Takes the refill lock and, only if it was free, reports depth, target and
/// the time of the last refill (ms) for the double check.
pub const ACQUIRE: &str = concat!(
    pool_lua!(),
    r#"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local meta = redis.call('HMGET', KEYS[3], 'target', 'refilled_at')
return {depth(KEYS[2]), tonumber(meta[1] or '0') or 0, tonumber(meta[2] or '0') or 0}
"#
);

/// KEYS: lock, pool, meta. ARGV: token, first, end (exclusive), target,
/// now_ms.
/// Appends a block (one run, joined to the last one when they touch) only
/// while the caller still holds the lock (a refill that outlived its lock
/// must not push numbers behind a newer block), stamps the server's run_id
/// so a pool replayed by another server is recognised, keeps the highest
/// block end ever pushed (`max_end`: Postgres must never be found behind
/// it), records the target and when it was used (`used_at`, on the
/// server's clock) and releases the lock. Returns the new depth,
/// or -1 if the lock was lost.
pub const PUSH: &str = concat!(
    pool_lua!(),
    give_back_lua!(),
    r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local first, last = tonumber(ARGV[2]), tonumber(ARGV[3]) - 1
if last >= first then
  local tail = redis.call('LINDEX', KEYS[2], -1)
  local a, b = nil, nil
  if tail then a, b = bounds(tail) end
  if not tail then
    redis.call('RPUSH', KEYS[2], run(first, last))
  elseif a and b + 1 == first then
    redis.call('LSET', KEYS[2], -1, run(a, last))
  elseif a and b < first then
    redis.call('RPUSH', KEYS[2], run(first, last))
  else
    -- Never seen (blocks come from the counter, above all a pool holds),
    -- but the list stays ascending whatever comes.
    give_back(KEYS[2], {first, last})
  end
end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
local max_end = tonumber(redis.call('HGET', KEYS[3], 'max_end') or '0') or 0
if tonumber(ARGV[3]) > max_end then max_end = tonumber(ARGV[3]) end
redis.call('HSET', KEYS[3], 'run_id', run_id, 'max_end', string.format('%d', max_end),
  'target', ARGV[4], 'refilled_at', ARGV[5], 'used_at', string.format('%d', now_ms()))
redis.call('DEL', KEYS[1])
return depth(KEYS[2])
"#
);

/// KEYS: lock. ARGV: token. Compare-and-delete: never frees another holder's lock.
pub const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// KEYS: pool, meta, inflight, lock. ARGV: count, token, deadline (ms on
/// the server's clock, 0 for none), then tokens of earlier pops whose
/// answers arrived (forgotten here).
/// Pops up to `count` numbers off the head and reports them as flat
/// first, last pairs, with what is left, the pool's target (0 for a pool
/// never filled, -1 for one whose first refill holds the lock), the
/// server's time (ms) and whether the pop came too late (1). A pop the server runs
/// after its caller gave up takes nothing: past its deadline, or after its
/// caller cancelled its token (see [`RESOLVE_POP`]). What a pop takes is
/// kept under its token in `inflight` until its caller says it got the
/// answer, so a pop whose answer was lost with its connection is found and
/// given back. A pop that takes numbers stamps `used_at`: a pool unused
/// for long is given back (see [`SWEEP`]).
pub const POP: &str = concat!(
    pool_lua!(),
    r#"
local inflight = KEYS[3]
for i = 4, #ARGV do redis.call('HDEL', inflight, ARGV[i]) end
local now = now_ms()
local target = tonumber(redis.call('HGET', KEYS[2], 'target') or '0') or 0
local deadline = tonumber(ARGV[3])
-- A refill under way somewhere (its lock held): the pool is being
-- filled, whatever its target says.
if target == 0 and redis.call('EXISTS', KEYS[4]) == 1 then target = -1 end
if redis.call('HDEL', inflight, ARGV[2]) == 1 or (deadline > 0 and now > deadline) then
  return {{}, depth(KEYS[1]), target, now, 1}
end
local want = tonumber(ARGV[1])
local taken = {}
while want > 0 do
  local head = redis.call('LINDEX', KEYS[1], 0)
  if not head then break end
  local a, b = bounds(head)
  if not a then
    -- Nothing a script of ours writes; it would stop the pool for good.
    redis.call('LPOP', KEYS[1])
  elseif b - a + 1 <= want then
    redis.call('LPOP', KEYS[1])
    taken[#taken + 1] = a
    taken[#taken + 1] = b
    want = want - (b - a + 1)
  else
    redis.call('LSET', KEYS[1], 0, run(a + want, b))
    taken[#taken + 1] = a
    taken[#taken + 1] = a + want - 1
    want = 0
  end
end
local out = texts(taken)
if #out > 0 then
  redis.call('HSET', inflight, ARGV[2], table.concat(out, ','))
  redis.call('PEXPIRE', inflight, 3600000)
  redis.call('HSET', KEYS[2], 'used_at', string.format('%d', now))
end
return {out, depth(KEYS[1]), target, now, 0}
"#
);

/// KEYS: pool, inflight. ARGV: token.
/// Settles a pop whose caller got no answer (a timeout, a lost
/// connection): if it ran, its numbers (which nobody received) go back to
/// the head of the pool, merged as by [`GIVE_BACK`]; if not, its token is
/// cancelled so that, run later, it takes nothing. Returns how many
/// numbers went back.
pub const RESOLVE_POP: &str = concat!(
    pool_lua!(),
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
local back, n = {}, 0
for v in string.gmatch(entry, '[^,]+') do back[#back + 1] = tonumber(v) end
for i = 1, #back - 1, 2 do n = n + back[i + 1] - back[i] + 1 end
if n == 0 then return 0 end
give_back(KEYS[1], back)
return n
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
/// Takes up to `part` runs off a drained pool; returns how many runs are
/// left and those taken as flat first, last pairs.
pub const DRAIN: &str = concat!(
    pool_lua!(),
    r#"
local part = tonumber(ARGV[1])
local values = redis.call('LRANGE', KEYS[1], 0, part - 1)
redis.call('LTRIM', KEYS[1], part, -1)
local taken = {}
for _, s in ipairs(values) do
  local a, b = bounds(s)
  if a then
    taken[#taken + 1] = a
    taken[#taken + 1] = b
  end
end
return {redis.call('LLEN', KEYS[1]), texts(taken)}
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

/// KEYS: pool, inflight, meta. ARGV: token, deadline (ms on the server's
/// clock, 0 for none), then the runs to give back as flat first, last
/// pairs.
/// Puts numbers back keeping the pool ascending, so its head stays its
/// lowest number (what requests take next): the pool's runs that start
/// at or below the highest number given back come off its head and go
/// back merged with them. Those are only numbers given back earlier (a
/// pool's numbers above a leased one were all there when it was leased,
/// and refills go to the tail), so few.
/// Once per token (kept an hour): a give-back whose answer was lost is
/// tried again with its token, and whichever of the two runs second puts
/// nothing back. Run twice, it put back numbers requests had taken since
/// the first (a review saw 46 and 47 answered, then back in their pool).
/// Past its deadline it puts nothing back and answers -2: a pool given
/// back to the counter once it was idle (see [`SWEEP`]) may have taken
/// these numbers along had an earlier try landed, and the counter would
/// hand them out again. Returns the pool's depth.
pub const GIVE_BACK: &str = concat!(
    pool_lua!(),
    give_back_lua!(),
    r#"
local now = now_ms()
local deadline = tonumber(ARGV[2]) or 0
if deadline > 0 and now > deadline then return -2 end
local first = redis.call('HSETNX', KEYS[2], 'back:' .. ARGV[1], '1')
redis.call('PEXPIRE', KEYS[2], 3600000)
if first == 0 then return depth(KEYS[1]) end
local back = {}
for i = 3, #ARGV do back[i - 2] = tonumber(ARGV[i]) end
redis.call('HSET', KEYS[3], 'used_at', string.format('%d', now))
return give_back(KEYS[1], back)
"#
);

/// KEYS: pool. ARGV: max, part.
/// Removes the numbers above `max` from the tail of the ascending pool,
/// looking at up to `part` runs; returns whether more may be left (1) and
/// the numbers removed as flat first, last pairs.
pub const TRIM_ABOVE: &str = concat!(
    pool_lua!(),
    r#"
local max, part = tonumber(ARGV[1]), tonumber(ARGV[2])
local removed, looked = {}, 0
while looked < part do
  local tail = redis.call('LINDEX', KEYS[1], -1)
  if not tail then break end
  local a, b = bounds(tail)
  looked = looked + 1
  if not a then
    redis.call('RPOP', KEYS[1])
  elseif b <= max then
    break
  elseif a > max then
    redis.call('RPOP', KEYS[1])
    removed[#removed + 1] = a
    removed[#removed + 1] = b
  else
    redis.call('LSET', KEYS[1], -1, run(a, max))
    removed[#removed + 1] = max + 1
    removed[#removed + 1] = b
    break
  end
end
if looked == part then return {1, texts(removed)} end
return {0, texts(removed)}
"#
);

/// KEYS: pool. The numbers the pool holds, and its lowest (false when it
/// is empty).
pub const DEPTH: &str = concat!(
    pool_lua!(),
    r#"
local lowest = false
local head = redis.call('LINDEX', KEYS[1], 0)
local a = head and bounds(head)
if a then lowest = string.format('%d', a) end
return {depth(KEYS[1]), lowest}
"#
);

/// KEYS: lock, pool, meta, inflight, drain. ARGV: idle_ms.
/// Gives up a pool nobody popped from or gave back to for `idle_ms` (0: at
/// once, an ended period's): unless a refill holds its lock, the list is
/// renamed to `drain` (read back in parts like a discarded one), the
/// numbers of pops still kept in `inflight` (answers lost: their callers
/// may never settle them now) are returned, and the pool's keys go, so an
/// idle sequence costs Redis nothing. Returns {1, drained (1 if there was
/// a list), pops' runs as flat first, last pairs}; or, when the pool is in
/// use (or has no key at all), {0, its lowest number or false}.
pub const SWEEP: &str = concat!(
    pool_lua!(),
    r#"
local lowest = false
local head = redis.call('LINDEX', KEYS[2], 0)
local a = head and bounds(head)
if a then lowest = string.format('%d', a) end
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, lowest} end
if redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4]) == 0 then return {0, false} end
-- On the server's clock only (`refilled_at` is the instance's, which a
-- test or bench may move ahead): stamped by every pop, push and give-back.
local used = tonumber(redis.call('HGET', KEYS[3], 'used_at') or '0') or 0
if now_ms() - used < tonumber(ARGV[1]) then return {0, lowest} end
local popped = {}
local entries = redis.call('HGETALL', KEYS[4])
for i = 1, #entries - 1, 2 do
  local field, value = entries[i], entries[i + 1]
  if string.sub(field, 1, 5) ~= 'back:' and value ~= 'cancelled' then
    for v in string.gmatch(value, '[^,]+') do popped[#popped + 1] = v end
  end
end
local drained = 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], KEYS[5])
  redis.call('PEXPIRE', KEYS[5], 3600000)
  drained = 1
end
redis.call('DEL', KEYS[3], KEYS[4])
return {1, drained, popped}
"#
);
