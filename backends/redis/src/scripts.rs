//! The Lua scripts that read and change records atomically on the server.
//!
//! Layout of one namespace with prefix `P` (all keys carry the hash tag `{P}`, so they share one
//! Redis Cluster slot and every script's keys are in the same slot):
//!
//! | key | type | content |
//! | --- | --- | --- |
//! | `{P}rec:<lease key>` | hash | `v` = version (decimal counter), `d` = record JSON ([`leasehold::codec`]) |
//! | `{P}index` | sorted set | every lease key, all with score 0 (ordered by name, for `list`) |
//! | `{P}rev` | string | the namespace revision counter every write increments (decimal) |
//! | `{P}tok:<lease key>` | string | the last fencing token an acquisition assigned for the key (decimal); kept when the record is deleted |
//!
//! and the pub/sub channel `{P}chan:<lease key>`, on which every write publishes
//! `p:<version>:<record JSON>` or `d:<version>` (delete).
//!
//! **Exact integers.** Versions, the counter and tokens are unsigned 64-bit integers kept as
//! decimal strings, and the scripts compute with them as strings (increment, compare by length
//! and then digit by digit, maximum): Lua numbers are doubles and stop counting at 2^53. The
//! server clock is read as the exact string of its seconds followed by its six-digit
//! microseconds. A counter or high-water mark that is not a decimal integer (another type, other
//! text, above u64::MAX), or a version or token that would exceed u64::MAX, is refused with a
//! `badnum` reply before anything is written; the store turns it into a typed error.
//!
//! Versions come from the namespace counter, like etcd's revisions: they never repeat, also not
//! after a delete and re-create, so a watcher can drop anything at or below what it has seen.
//! Every write sets the counter to the largest of: the counter plus one, the server's clock
//! (`TIME`) in microseconds, and the replaced version plus one. So a version is never below the
//! server clock, and versions keep growing when the counter went back or vanished: after a
//! restart without persistence, a restore from an older RDB/AOF snapshot, or a failover to a
//! replica that lagged behind. A version issued before such a loss is therefore not issued again,
//! and a compare-and-swap with it cannot match a record written after the loss by accident.
//! (Two exceptions: the server's clock went back by more than the lost writes' lead, or more
//! than a million writes a second were sustained before the loss, which pushes the counter ahead
//! of the clock.)
//!
//! **Fencing tokens** are assigned at commit by the acquire script
//! ([`LeaseStore::acquire`](leasehold::LeaseStore::acquire)): the largest of the write's new
//! version, the key's high-water mark `{P}tok:<lease key>` plus one, and the caller's floor.
//! The script writes that token into the record JSON as `leaderTransitions` and into the
//! high-water mark, in the same atomic step as the write. So a token is strictly above every
//! token assigned for the key before while the high-water mark survives (a delete keeps it),
//! and never below the server clock in microseconds, like the versions it is built from.
//!
//! The fencing seed ([`LeaseStore::fencing_seed`](leasehold::LeaseStore::fencing_seed), for an
//! elector that cannot use `acquire`) is read by a script that writes nothing: one above the
//! largest of the counter, the key's version, the key's high-water mark and the server clock in
//! microseconds.
//!
//! Data under a record key that is not such a hash (another type, a hash without `v`/`d`) is
//! foreign. Its version is `x` followed by the SHA-1 of its `DUMP` serialisation: it stays the same
//! while the data stays the same and changes when it changes, so the elector can replace the
//! data by compare-and-swap once it has stayed unchanged for a lease duration. A hash whose `v` is
//! a counter but whose `d` is not a valid record keeps `v` as its version.

use redis::Script;

/// Shared Lua helpers, prepended to every script.
///
/// Every version, counter and token is a decimal string and all arithmetic on them is exact
/// string arithmetic: Lua numbers are doubles, which lose `+1` at 2^53.
const PRELUDE: &str = r#"
local U64_MAX = '18446744073709551615'
-- s as a canonical decimal (no leading zeros), or nil when s is not a decimal integer.
local function dec(s)
  if type(s) ~= 'string' or not string.match(s, '^[0-9]+$') then return nil end
  local t = string.gsub(s, '^0+', '')
  if t == '' then return '0' end
  return t
end
-- a < b for canonical decimals: by length, then digit by digit.
local function dec_lt(a, b)
  if #a ~= #b then return #a < #b end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return false
end
local function dec_max(a, b)
  if dec_lt(a, b) then return b end
  return a
end
-- s + 1 for a canonical decimal.
local function dec_inc(s)
  local i = #s
  while i > 0 and string.byte(s, i) == 57 do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end
local function fits(s) return not dec_lt(U64_MAX, s) end
local function cur(key)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return nil, nil end
  if t == 'hash' then
    local f = redis.call('HMGET', key, 'v', 'd')
    if f[1] and f[2] and string.match(f[1], '^[1-9][0-9]*$') then
      return f[1], f[2]
    end
  end
  return 'x' .. redis.sha1hex(redis.call('DUMP', key)), false
end
-- The server clock in microseconds, exactly: seconds .. six digits of microseconds.
local function now_us()
  local t = redis.call('TIME')
  return dec(t[1] .. string.rep('0', 6 - #t[2]) .. t[2]) or '0'
end
-- The decimal integer under key ('0' when absent), or nil and the reply that refuses it
-- ({'badnum', role, what it holds, 'notint'}). A value above u64::MAX is refused too.
local function stored(key, role)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return '0' end
  if t ~= 'string' then return nil, {'badnum', role, 'a redis ' .. t, 'notint'} end
  local raw = redis.call('GET', key)
  local v = dec(raw)
  if not v or not fits(v) then return nil, {'badnum', role, raw, 'notint'} end
  return v
end
-- The next version: the largest of the counter plus one, the server clock in microseconds and
-- the replaced version cv plus one. Or nil and the reply that refuses it ('overflow' when it
-- would exceed u64::MAX). Writes nothing; the caller SETs the counter to it.
local function next_version(revkey, cv)
  local c, e = stored(revkey, 'counter')
  if not c then return nil, e end
  if not fits(dec_inc(c)) then return nil, {'badnum', 'counter', c, 'overflow'} end
  local nv = dec_max(dec_inc(c), now_us())
  local r = dec(cv)
  if r then
    if not fits(dec_inc(r)) then return nil, {'badnum', 'version', r, 'overflow'} end
    nv = dec_max(nv, dec_inc(r))
  end
  return nv
end
"#;

/// KEYS: rec, rev. Returns `{kind, version, data, rev}` with kind `none`, `rec` or `foreign`
/// (then `data` is the Redis type); `rev` is the counter as stored (`0` when it is missing or not
/// a string: a read never fails on the counter).
const GET: &str = r#"
local v, d = cur(KEYS[1])
local rev = '0'
if redis.call('TYPE', KEYS[2])['ok'] == 'string' then rev = redis.call('GET', KEYS[2]) end
if v == nil then return {'none', '', '', rev} end
if d == false then return {'foreign', v, redis.call('TYPE', KEYS[1])['ok'], rev} end
return {'rec', v, d, rev}
"#;

/// KEYS: any number of rec keys. Returns a flat list of `{kind, version, data}` per key.
const GET_MANY: &str = r#"
local out = {}
for i, k in ipairs(KEYS) do
  local v, d = cur(k)
  if v == nil then
    out[#out + 1] = 'none'; out[#out + 1] = ''; out[#out + 1] = ''
  elseif d == false then
    out[#out + 1] = 'foreign'; out[#out + 1] = v; out[#out + 1] = redis.call('TYPE', k)['ok']
  else
    out[#out + 1] = 'rec'; out[#out + 1] = v; out[#out + 1] = d
  end
end
return out
"#;

/// KEYS: rec, index, rev. ARGV: data, lease key, channel. Returns `{'exists'}`, a `badnum`
/// reply or `{'ok', v}`.
const CREATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
local nv, e = next_version(KEYS[3], nil)
if not nv then return e end
redis.call('SET', KEYS[3], nv)
redis.call('HSET', KEYS[1], 'v', nv, 'd', ARGV[1])
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('PUBLISH', ARGV[3], 'p:' .. nv .. ':' .. ARGV[1])
return {'ok', nv}
"#;

/// KEYS: rec, index, rev. ARGV: expected, data, lease key, channel.
/// Returns `{'notfound'}`, `{'conflict', current}`, a `badnum` reply or `{'ok', v}`.
const UPDATE: &str = r#"
local cv = cur(KEYS[1])
if cv == nil then return {'notfound'} end
if cv ~= ARGV[1] then return {'conflict', cv} end
local nv, e = next_version(KEYS[3], cv)
if not nv then return e end
redis.call('SET', KEYS[3], nv)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', nv, 'd', ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('PUBLISH', ARGV[4], 'p:' .. nv .. ':' .. ARGV[2])
return {'ok', nv}
"#;

/// KEYS: rec, index, rev, tok. ARGV: `create` or `update`, expected (ignored by `create`),
/// record JSON before the token, record JSON after the token, floor, lease key, channel.
///
/// An acquisition: like CREATE or UPDATE, with the fencing token assigned here, at commit: the
/// largest of the new version, the key's token high-water mark plus one and the floor. The
/// record is written with that token as its `leaderTransitions`, and the high-water mark is set
/// to it. Returns `{'exists'}`, `{'notfound'}`, `{'conflict', current}`, a `badnum` reply (role
/// `token` with `overflow`: no higher token exists; nothing is written) or `{'ok', v, token}`.
const ACQUIRE: &str = r#"
local cv = cur(KEYS[1])
if ARGV[1] == 'create' then
  if cv ~= nil then return {'exists'} end
else
  if cv == nil then return {'notfound'} end
  if cv ~= ARGV[2] then return {'conflict', cv} end
end
local nv, e = next_version(KEYS[3], cv)
if not nv then return e end
local last, e2 = stored(KEYS[4], 'token')
if not last then return e2 end
if not fits(dec_inc(last)) then return {'badnum', 'token', last, 'overflow'} end
local token = dec_max(dec_max(nv, dec_inc(last)), dec(ARGV[5]) or '0')
local data = ARGV[3] .. token .. ARGV[4]
redis.call('SET', KEYS[3], nv)
redis.call('SET', KEYS[4], token)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', nv, 'd', data)
redis.call('ZADD', KEYS[2], 0, ARGV[6])
redis.call('PUBLISH', ARGV[7], 'p:' .. nv .. ':' .. data)
return {'ok', nv, token}
"#;

/// KEYS: rec, index, rev. ARGV: expected, lease key, channel.
/// Returns `{'notfound'}`, `{'conflict', current}`, a `badnum` reply or `{'ok', v}`.
const DELETE: &str = r#"
local cv = cur(KEYS[1])
if cv == nil then return {'notfound'} end
if cv ~= ARGV[1] then return {'conflict', cv} end
local nv, e = next_version(KEYS[3], cv)
if not nv then return e end
redis.call('SET', KEYS[3], nv)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[3], 'd:' .. nv)
return {'ok', nv}
"#;

/// KEYS: rec, rev, tok. Returns `{'ok', seed}`: one above the largest of the namespace counter,
/// the key's version (when it is one of ours), the key's token high-water mark and the server
/// clock in microseconds; or a `badnum` reply (role `token` with `overflow` when no seed fits
/// in a u64). Writes nothing.
const SEED: &str = r#"
local s, e = stored(KEYS[2], 'counter')
if not s then return e end
local t, e2 = stored(KEYS[3], 'token')
if not t then return e2 end
s = dec_max(dec_max(s, t), now_us())
local c = dec((cur(KEYS[1])))
if c then s = dec_max(s, c) end
if not fits(dec_inc(s)) then return {'badnum', 'token', s, 'overflow'} end
return {'ok', dec_inc(s)}
"#;

/// One script: its source and SHA-1.
pub(crate) struct Lua {
    code: String,
    sha: String,
}

impl Lua {
    fn new(body: &str) -> Self {
        let code = format!("{PRELUDE}{body}");
        let sha = Script::new(&code).get_hash().to_owned();
        Lua { code, sha }
    }

    /// Starts a call of this script.
    pub(crate) fn call(&self) -> Call<'_> {
        Call {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// A prepared script call.
pub(crate) struct Call<'a> {
    lua: &'a Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call<'_> {
    pub(crate) fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.keys.push(key.into());
        self
    }

    pub(crate) fn arg(mut self, arg: impl Into<Vec<u8>>) -> Self {
        self.args.push(arg.into());
        self
    }

    fn command(&self, name: &str, script: &str) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(script)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }

    /// Runs the script by SHA (`EVALSHA`). On `NOSCRIPT` (a restarted server, `SCRIPT FLUSH`)
    /// it loads the script and tries `EVALSHA` again, and if the cache was flushed once more in
    /// between, falls back to `EVAL` with the source, which cannot miss. `NOSCRIPT` means the
    /// script did not run, so retrying never applies a write twice.
    pub(crate) async fn invoke<T: redis::FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<T> {
        let evalsha = self.command("EVALSHA", &self.lua.sha);
        match evalsha.query_async(conn).await {
            Err(e) if is_noscript(&e) => {}
            other => return other,
        }
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&self.lua.code)
            .query_async::<()>(conn)
            .await?;
        match evalsha.query_async(conn).await {
            Err(e) if is_noscript(&e) => {
                self.command("EVAL", &self.lua.code).query_async(conn).await
            }
            other => other,
        }
    }
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// The scripts of the store.
pub(crate) struct Scripts {
    pub(crate) get: Lua,
    pub(crate) get_many: Lua,
    pub(crate) create: Lua,
    pub(crate) update: Lua,
    pub(crate) delete: Lua,
    pub(crate) acquire: Lua,
    pub(crate) seed: Lua,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            get: Lua::new(GET),
            get_many: Lua::new(GET_MANY),
            create: Lua::new(CREATE),
            update: Lua::new(UPDATE),
            delete: Lua::new(DELETE),
            acquire: Lua::new(ACQUIRE),
            seed: Lua::new(SEED),
        }
    }
}
