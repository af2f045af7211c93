//! Lua run inside Redis, so each step on a pool is one atomic round trip.
//! Every script touches the keys of one sequence period only; they share a
//! hash tag and so one Redis Cluster slot.

/// KEYS: pool, meta. ARGV: count.
/// Pops up to `count` numbers and reports what is left and the pool's target.
pub const POP: &str = r#"
local popped = redis.call('LPOP', KEYS[1], ARGV[1])
if not popped then popped = {} end
local depth = redis.call('LLEN', KEYS[1])
local target = tonumber(redis.call('HGET', KEYS[2], 'target') or '0') or 0
return {popped, depth, target}
"#;

/// KEYS: lock, pool, meta. ARGV: token, ttl_ms.
/// Takes the refill lock and, only if it was free, reports depth, target and
/// the time of the last refill (ms) for the double check.
pub const ACQUIRE: &str = r#"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local depth = redis.call('LLEN', KEYS[2])
local meta = redis.call('HMGET', KEYS[3], 'target', 'refilled_at')
return {depth, tonumber(meta[1] or '0') or 0, tonumber(meta[2] or '0') or 0}
"#;

/// KEYS: lock, pool, meta. ARGV: token, first, end (exclusive), target, now_ms.
/// Appends the block only while the caller still holds the lock (a refill
/// that outlived its lock must not push numbers behind a newer block), stamps
/// the server's run_id so a pool replayed by another server is recognised,
/// keeps the highest block end ever pushed (`max_end`: Postgres must never
/// be found behind it), and releases the lock. Returns the new depth, or -1
/// if the lock was lost.
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
redis.call('HSET', KEYS[3], 'target', ARGV[4], 'refilled_at', ARGV[5], 'run_id', run_id,
  'max_end', string.format('%d', max_end))
redis.call('DEL', KEYS[1])
return redis.call('LLEN', KEYS[2])
"#;

/// KEYS: lock. ARGV: token. Compare-and-delete: never frees another holder's lock.
pub const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#;

/// KEYS: pool, meta. ARGV: 'foreign' (empty the pool unless this very
/// server filled it) or 'all'.
/// Returns the numbers it held as flat [first, last] pairs of consecutive
/// runs. The server is the one holding the pool: in a cluster each pool is
/// judged by its own node, so one node's restart costs only its pools.
pub const DISCARD: &str = r#"
if ARGV[1] == 'foreign' then
  local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
  if redis.call('HGET', KEYS[2], 'run_id') == run_id then return {} end
end
local values = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], 'run_id')
local out, n, first, prev = {}, 0, nil, nil
for _, v in ipairs(values) do
  local x = tonumber(v)
  if x then
    if prev and x == prev + 1 then
      prev = x
    else
      if first then
        out[n + 1] = string.format('%d', first)
        out[n + 2] = string.format('%d', prev)
        n = n + 2
      end
      first, prev = x, x
    end
  end
end
if first then
  out[n + 1] = string.format('%d', first)
  out[n + 2] = string.format('%d', prev)
end
return out
"#;

/// KEYS: installation. ARGV: our installation id.
/// Claims the key prefix for one database; returns the id that owns it.
pub const CLAIM_PREFIX: &str = r#"
local owner = redis.call('GET', KEYS[1])
if not owner then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return owner
"#;

/// KEYS: pool. ARGV: max.
/// Removes the numbers above `max` from the tail of the ascending pool and
/// returns them as flat [first, last] pairs of consecutive runs.
pub const TRIM_ABOVE: &str = r#"
local max = tonumber(ARGV[1])
local out, n, first, last = {}, 0, nil, nil
while true do
  local tail = tonumber(redis.call('LINDEX', KEYS[1], -1))
  if not tail or tail <= max then break end
  redis.call('RPOP', KEYS[1])
  if last and tail == first - 1 then
    first = tail
  else
    if last then
      out[n + 1] = string.format('%d', first)
      out[n + 2] = string.format('%d', last)
      n = n + 2
    end
    first, last = tail, tail
  end
end
if last then
  out[n + 1] = string.format('%d', first)
  out[n + 2] = string.format('%d', last)
end
return out
"#;
