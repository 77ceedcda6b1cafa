//! The Lua scripts that read and change records atomically on the server.
//!
//! Layout of one namespace with prefix `P` (all keys carry the hash tag `{P}`, so they share one
//! Redis Cluster slot and every script's keys are in the same slot):
//!
//! | key | type | content |
//! | --- | --- | --- |
//! | `{P}rec:<lease key>` | hash | `v` = version (decimal counter), `d` = record JSON ([`leasehold::codec`]) |
//! | `{P}index` | sorted set | every lease key, all with score 0 (ordered by name, for `list`) |
//! | `{P}rev` | string | the namespace revision counter every write increments |
//!
//! and the pub/sub channel `{P}chan:<lease key>`, on which every write publishes
//! `p:<version>:<record JSON>` or `d:<version>` (delete).
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
//! The fencing seed ([`LeaseStore::fencing_seed`](leasehold::LeaseStore::fencing_seed)) is read
//! by a script that writes nothing: one above the largest of the counter, the key's version and
//! the server clock in microseconds.
//!
//! Data under a record key that is not such a hash (another type, a hash without `v`/`d`) is
//! foreign. Its version is `x` followed by the SHA-1 of its `DUMP` serialisation: it stays the same
//! while the data stays the same and changes when it changes, so the elector can replace the
//! data by compare-and-swap once it has stayed unchanged for a lease duration. A hash whose `v` is
//! a counter but whose `d` is not a valid record keeps `v` as its version.

use redis::Script;

/// Shared Lua helpers, prepended to every script.
const PRELUDE: &str = r#"
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
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function counter(revkey)
  return tonumber(redis.call('GET', revkey) or '0') or 0
end
local function bump(revkey, cv)
  local nv = counter(revkey) + 1
  local now = now_us()
  if nv < now then nv = now end
  local c = tonumber(cv)
  if c and nv <= c then nv = c + 1 end
  nv = string.format('%d', nv)
  redis.call('SET', revkey, nv)
  return nv
end
"#;

/// KEYS: rec, rev. Returns `{kind, version, data, rev}` with kind `none`, `rec` or `foreign`
/// (then `data` is the Redis type).
const GET: &str = r#"
local v, d = cur(KEYS[1])
local rev = redis.call('GET', KEYS[2]) or '0'
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

/// KEYS: rec, index, rev. ARGV: data, lease key, channel. Returns `{'exists'}` or `{'ok', v}`.
const CREATE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
local nv = bump(KEYS[3], nil)
redis.call('HSET', KEYS[1], 'v', nv, 'd', ARGV[1])
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('PUBLISH', ARGV[3], 'p:' .. nv .. ':' .. ARGV[1])
return {'ok', nv}
"#;

/// KEYS: rec, index, rev. ARGV: expected, data, lease key, channel.
/// Returns `{'notfound'}`, `{'conflict', current}` or `{'ok', v}`.
const UPDATE: &str = r#"
local cv = cur(KEYS[1])
if cv == nil then return {'notfound'} end
if cv ~= ARGV[1] then return {'conflict', cv} end
local nv = bump(KEYS[3], cv)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', nv, 'd', ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('PUBLISH', ARGV[4], 'p:' .. nv .. ':' .. ARGV[2])
return {'ok', nv}
"#;

/// KEYS: rec, index, rev. ARGV: expected, lease key, channel.
/// Returns `{'notfound'}`, `{'conflict', current}` or `{'ok', v}`.
const DELETE: &str = r#"
local cv = cur(KEYS[1])
if cv == nil then return {'notfound'} end
if cv ~= ARGV[1] then return {'conflict', cv} end
local nv = bump(KEYS[3], cv)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[3], 'd:' .. nv)
return {'ok', nv}
"#;

/// KEYS: rec, rev. Returns the fencing seed: one above the largest of the namespace counter, the
/// key's version (when it is one of ours) and the server clock in microseconds. Writes nothing.
const SEED: &str = r#"
local s = counter(KEYS[2])
local c = tonumber((cur(KEYS[1])))
if c and c > s then s = c end
local now = now_us()
if now > s then s = now end
return string.format('%d', s + 1)
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
            seed: Lua::new(SEED),
        }
    }
}
