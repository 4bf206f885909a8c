// Black-box tests of `dflash serve` on the bundled pair (CPU), with the
// official OpenAI Node SDK as the client: greedy and seeded sampled responses
// equal `dflash generate`, streaming equals non-streaming, 32 concurrent streaming
// clients get their sequential outputs, bad input (deep nesting and unknown
// roles included) gets a clear 4xx while the server keeps serving, a client that disconnects frees its KV pages,
// and SIGTERM ends the server promptly with a kept-alive connection open (a second one at once mid-stream).
//
// Run: DFLASH_BINARY=build/dflash node --test tests/server/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import net from 'node:net';
import OpenAI from 'openai';

const BIN = process.env.DFLASH_BINARY ?? 'build/dflash';
// Sanitizer builds run about 10x slower: the concurrency test then uses 8 clients x 2 requests.
const LIGHT = process.env.DFLASH_TEST_LIGHT === '1';
const N_CLIENTS = LIGHT ? 8 : 32, N_REQUESTS = LIGHT ? 2 : 4;
const MODEL = 'pycoder-16m';
const PROMPTS = [
  'def fibonacci(n):',
  'import os\n\ndef list_files(path):\n    """Return the files under path."""\n',
  'class Stack:\n    def __init__(self):\n',
  'def is_prime(n: int) -> bool:\n',
];

// Starts a server on a free port; resolves with {proc, url} once it listens.
function startServer(args = []) {
  return new Promise((resolve, reject) => {
    const proc = spawn(BIN, ['serve', '--port', '0', '--read-timeout', '2', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    const timer = setTimeout(() => reject(new Error(`server did not start: ${out}`)), 60000);
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/at (http:\/\/127\.0\.0\.1:\d+)\/v1/);
      if (m) {
        clearTimeout(timer);
        resolve({ proc, url: m[1] });
      }
    });
    proc.stderr.on('data', (d) => { out += d; });
    proc.on('exit', (code) => reject(new Error(`server exited with ${code}: ${out}`)));
  });
}

function generate(args) {
  return JSON.parse(execFileSync(BIN, ['generate', '--json', ...args], { encoding: 'utf8' }));
}

async function metric(url, name) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(name + '{') || l.startsWith(name + ' '));
  assert.ok(line, `metric ${name} missing`);
  return Number(line.split(' ').pop());
}

async function streamText(client, params) {
  const stream = await client.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null, finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, usage, finish };
}

let server, client;
before(async () => {
  server = await startServer();
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 600000 });
});
after(() => server?.proc.kill('SIGTERM'));

test('models and health', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  assert.equal((await fetch(`${server.url}/health`)).status, 200);
});

test('completions equal dflash generate, streaming equals not streaming', async () => {
  for (const prompt of PROMPTS) {
    const ref = generate(['--prompt', prompt, '--max-tokens', '48']);
    const r = await client.completions.create({ model: MODEL, prompt, max_tokens: 48, temperature: 0 });
    assert.equal(r.choices[0].text, ref.text, `prompt ${JSON.stringify(prompt)}`);
    assert.equal(r.usage.prompt_tokens, ref.n_prompt_tokens);
    assert.equal(r.usage.completion_tokens, ref.tokens.length);
    assert.equal(r.choices[0].finish_reason, ref.stop_reason === 'eos' ? 'stop' : 'length');
    const s = await streamText(client, { model: MODEL, prompt, max_tokens: 48 });
    assert.equal(s.text, ref.text);
    assert.deepEqual(s.usage, r.usage);
    assert.equal(s.finish, r.choices[0].finish_reason);
  }
});

test('plain decoding (--speculative none) gives the same text', async () => {
  const ref = generate(['--prompt', PROMPTS[0], '--max-tokens', '40', '--speculative', 'none']);
  const r = await client.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 40 });
  assert.equal(r.choices[0].text, ref.text);
});

test('chat completions equal dflash generate --chat, streamed or not', async () => {
  const msg = 'Write a function that reverses a list.';
  const ref = generate(['--chat', msg, '--max-tokens', '40']);
  const params = { model: MODEL, messages: [{ role: 'user', content: msg }], max_tokens: 40,
                   chat_template_kwargs: { enable_thinking: false } };
  const r = await client.chat.completions.create(params);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, ref.text);
  const stream = await client.chat.completions.create({ ...params, stream: true });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(text, ref.text);
});

test('stop strings end the text, matched across tokens, never emitted', async () => {
  const full = (await client.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 48 })).choices[0].text;
  const stop = full.slice(10, 14);  // likely spans a token boundary
  const cut = full.indexOf(stop);
  const r = await client.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 48, stop: [stop] });
  assert.equal(r.choices[0].text, full.slice(0, cut));
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await streamText(client, { model: MODEL, prompt: PROMPTS[0], max_tokens: 48, stop });
  assert.equal(s.text, full.slice(0, cut));
});

test('32 concurrent streaming clients x 4 requests get their sequential outputs; all pages free after', async () => {
  const prompts = [];
  for (let i = 0; i < N_CLIENTS; ++i) prompts.push(`${PROMPTS[i % PROMPTS.length]}    # variant ${i}\n`);
  const expected = [];
  for (const p of prompts.slice(0, 8)) {  // sequential references for a sample; the rest are checked for consistency
    expected.push((await client.completions.create({ model: MODEL, prompt: p, max_tokens: 24 })).choices[0].text);
  }
  const results = await Promise.all(prompts.map(async (p) => {
    const texts = [];
    for (let k = 0; k < N_REQUESTS; ++k) texts.push((await streamText(client, { model: MODEL, prompt: p, max_tokens: 24 })).text);
    return texts;
  }));
  results.forEach((texts, i) => {
    texts.forEach((t) => assert.equal(t, texts[0], `client ${i} got different outputs for the same prompt`));
    if (i < expected.length) assert.equal(texts[0], expected[i], `client ${i} differs from its sequential run`);
  });
  assert.equal(await metric(server.url, 'dflash_kv_pages_used'), 0);
  assert.ok(await metric(server.url, 'dflash_kv_pages_free') > 0);
});

test('a client that disconnects mid-stream frees its pages', async () => {
  const ctl = new AbortController();
  const stream = await client.completions.create(
    { model: MODEL, prompt: PROMPTS[1], max_tokens: 1500, stream: true }, { signal: ctl.signal });
  let n = 0;
  try {
    for await (const chunk of stream) {
      if (++n === 3) {
        assert.ok(await metric(server.url, 'dflash_kv_pages_used') > 0);
        ctl.abort();
      }
    }
  } catch (e) {
    assert.ok(e instanceof OpenAI.APIUserAbortError || e.name === 'AbortError', String(e));
  }
  let used = -1;
  for (let i = 0; i < 50 && used !== 0; ++i) {
    await new Promise((r) => setTimeout(r, 100));
    used = await metric(server.url, 'dflash_kv_pages_used');
  }
  assert.equal(used, 0, 'pages still in use after the client went away');
});

test('a non-streaming client that goes away frees its pages', async () => {
  const tokensBefore = await metric(server.url, 'dflash_generation_tokens_total');
  const ctl = new AbortController();
  const pending = client.completions
    .create({ model: MODEL, prompt: PROMPTS[1], max_tokens: 1500 }, { signal: ctl.signal })
    .then(() => null, (e) => e);
  let used = 0;
  for (let i = 0; i < 200 && used === 0; ++i) {
    await new Promise((r) => setTimeout(r, 50));
    used = await metric(server.url, 'dflash_kv_pages_used');
  }
  assert.ok(used > 0, 'the request never started');
  ctl.abort();
  const err = await pending;
  assert.ok(err instanceof OpenAI.APIUserAbortError || err?.name === 'AbortError', String(err));
  for (let i = 0; i < 100 && used !== 0; ++i) {
    await new Promise((r) => setTimeout(r, 100));
    used = await metric(server.url, 'dflash_kv_pages_used');
  }
  assert.equal(used, 0, 'pages still in use after the client went away');
  // Fewer than its 1500 tokens were generated (the engine counts cancelled
  // requests among the finished ones, so that count cannot tell).
  assert.ok(await metric(server.url, 'dflash_generation_tokens_total') - tokensBefore < 1500,
            'the request ran to completion instead of being cancelled');
});

async function post(path, body, headers = { 'Content-Type': 'application/json' }) {
  const res = await fetch(`${server.url}${path}`, { method: 'POST', headers, body });
  const text = await res.text();
  return { status: res.status, body: text };
}

test('sampled completions with a seed equal dflash generate with that seed (match scheme = plain sampling)', async () => {
  for (const [i, prompt] of PROMPTS.slice(0, 2).entries()) {
    const params = { temperature: 0.8, top_p: 0.95, seed: 11 + i };
    const ref = generate(['--prompt', prompt, '--max-tokens', '32', '--speculative', 'none', '--temperature', '0.8',
                          '--top-p', '0.95', '--seed', String(params.seed)]);
    const r = await client.completions.create({ model: MODEL, prompt, max_tokens: 32, ...params });
    assert.equal(r.choices[0].text, ref.text, `prompt ${JSON.stringify(prompt)}`);
    const s = await streamText(client, { model: MODEL, prompt, max_tokens: 32, ...params });
    assert.equal(s.text, ref.text);
  }
  // Without a seed, each request draws its own: 4 samples of a long continuation are not all equal.
  const texts = new Set();
  for (let k = 0; k < 4; ++k) {
    const r = await client.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 24, temperature: 1.0 });
    texts.add(r.choices[0].text);
  }
  assert.ok(texts.size > 1, 'unseeded sampled requests all gave the same text');
});

test('bad input gets a clear 4xx in OpenAI error shape, and the server keeps serving', async () => {
  const longPrompt = 'x = 1\n'.repeat(3000);
  const cases = [
    ['malformed JSON', '{"prompt": ', 400, /not valid JSON/],
    ['not an object', '[1, 2]', 400, /must be a JSON object/],
    ['wrong type', JSON.stringify({ model: MODEL, prompt: 'a', max_tokens: 'ten' }), 400, /max_tokens/],
    ['unknown field', JSON.stringify({ model: MODEL, prompt: 'a', bogus: 1 }), 400, /unknown field 'bogus'/],
    ['empty prompt', JSON.stringify({ model: MODEL, prompt: '' }), 400, /empty/],
    ['prompt longer than the context', JSON.stringify({ model: MODEL, prompt: longPrompt }), 400, /context/],
    ['max_tokens <= 0', JSON.stringify({ model: MODEL, prompt: 'a', max_tokens: 0 }), 400, /positive/],
    ['absurd max_tokens', JSON.stringify({ model: MODEL, prompt: 'a', max_tokens: 1e12 }), 400, /max_tokens/],
    ['max_tokens beyond the context', JSON.stringify({ model: MODEL, prompt: 'a', max_tokens: 5000 }), 400, /context/],
    ['temperature out of range', JSON.stringify({ model: MODEL, prompt: 'a', temperature: 3 }), 400, /temperature/],
    ['top_p of 0', JSON.stringify({ model: MODEL, prompt: 'a', top_p: 0 }), 400, /top_p/],
    ['top_k not an integer', JSON.stringify({ model: MODEL, prompt: 'a', top_k: 2.5 }), 400, /top_k/],
    ['n = 17', JSON.stringify({ model: MODEL, prompt: 'a', n: 17 }), 400, /'n'/],
    ['unknown model', JSON.stringify({ model: 'gpt-9', prompt: 'a' }), 404, /does not exist/],
    ['chat: bad messages', JSON.stringify({ model: MODEL, messages: 'hi' }), 400, /messages/],
    ['chat: unknown role', JSON.stringify({ model: MODEL, messages: [{ role: 'bogus', content: 'x' }] }), 400,
     /messages\[0\]\.role 'bogus'/],
    // 100,000 levels in 200 KB used to overflow the stack and end the server.
    ['nesting 100,000 deep', '{"prompt":' + '['.repeat(100000) + ']'.repeat(100000) + '}', 400, /128 levels/],
    ['chat: nesting 20,000 deep', JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'x' }] })
      .replace('"x"', '['.repeat(20000) + ']'.repeat(20000)), 400, /128 levels/],
  ];
  for (const [name, body, status, re] of cases) {
    const path = name.startsWith('chat:') ? '/v1/chat/completions' : '/v1/completions';
    const r = await post(path, body);
    assert.equal(r.status, status, `${name}: ${r.body}`);
    const err = JSON.parse(r.body).error;
    assert.match(err.message, re, name);
    assert.ok(err.type, name);
  }
  const invalidUtf8 = Buffer.concat([Buffer.from('{"model": "pycoder-16m", "prompt": "'), Buffer.from([0xff, 0xfe]), Buffer.from('"}')]);
  const bad = await post('/v1/completions', invalidUtf8);
  assert.equal(bad.status, 400);
  assert.match(JSON.parse(bad.body).error.message, /UTF-8/);
  const huge = await post('/v1/completions', JSON.stringify({ model: MODEL, prompt: 'a'.repeat(10 * 1024 * 1024) }));
  assert.equal(huge.status, 413);
  // Still serving.
  const ok = await client.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 8 });
  assert.equal(ok.choices[0].finish_reason, 'length');
});

test('a client that sends slowly or never finishes is dropped and others are served', async () => {
  const { port, hostname } = new URL(server.url);
  const sock = net.connect(Number(port), hostname);
  sock.on('error', () => {});
  await new Promise((r) => sock.once('connect', r));
  sock.write('POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro');
  let reply = '';
  // After the server's read timeout (2 s here) it answers with a 4xx; the
  // connection may then stay open for keep-alive, so wait for the status line.
  const answered = new Promise((r) => {
    sock.on('data', (d) => { reply += d; if (/\r\n/.test(reply)) r(); });
    sock.once('close', r);
  });
  const t0 = Date.now();
  const ok = await client.completions.create({ model: MODEL, prompt: PROMPTS[2], max_tokens: 8 });
  assert.equal(ok.usage.completion_tokens, 8);
  await answered;
  sock.destroy();
  assert.ok(Date.now() - t0 < 15000, `answered after ${Date.now() - t0} ms`);
  assert.match(reply, /^HTTP\/1\.1 4\d\d/);
});

test('--api-key requires Authorization: Bearer', async () => {
  const secured = await startServer(['--api-key', 'sekret', '--speculative', 'none', '--max-num-seqs', '2']);
  try {
    const anon = await fetch(`${secured.url}/v1/models`);
    assert.equal(anon.status, 401);
    assert.equal((await anon.json()).error.type, 'authentication_error');
    const wrong = new OpenAI({ baseURL: `${secured.url}/v1`, apiKey: 'nope', maxRetries: 0 });
    await assert.rejects(wrong.models.list(), (e) => e.status === 401);
    const right = new OpenAI({ baseURL: `${secured.url}/v1`, apiKey: 'sekret', maxRetries: 0 });
    const r = await right.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 4 });
    assert.equal(r.usage.completion_tokens, 4);
  } finally {
    secured.proc.kill('SIGTERM');
  }
});

test('SIGTERM: an open kept-alive connection does not hold the exit; a second signal exits at once', async () => {
  const exited = (proc) => new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
  // A raw kept-alive connection that has had its answer and stays open.
  const keptAlive = async (url) => {
    const { port } = new URL(url);
    const sock = net.connect(Number(port), '127.0.0.1');
    await new Promise((resolve) => sock.once('connect', resolve));
    const answered = new Promise((resolve) => sock.once('data', resolve));
    sock.write('GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n');
    assert.match(String(await answered), /^HTTP\/1\.1 200/);
    return sock;
  };
  const idle = await startServer(['--speculative', 'none', '--max-num-seqs', '2']);
  const sock = await keptAlive(idle.url);
  const done = exited(idle.proc);
  const t0 = Date.now();
  idle.proc.kill('SIGTERM');
  const first = await done;
  assert.equal(first.code, 0);
  assert.ok(Date.now() - t0 < 5000, `exit took ${Date.now() - t0} ms`);
  sock.destroy();

  // A stream in flight is waited for after one signal; a second one ends the server at once.
  const busy = await startServer(['--speculative', 'none', '--max-num-seqs', '2']);
  const c = new OpenAI({ baseURL: `${busy.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  const stream = await c.completions.create({ model: MODEL, prompt: PROMPTS[0], max_tokens: 2000, ignore_eos: true, stream: true });
  const it = stream[Symbol.asyncIterator]();
  await it.next();  // generating
  const gone = exited(busy.proc);
  busy.proc.kill('SIGTERM');
  await new Promise((r) => setTimeout(r, 300));
  busy.proc.kill('SIGTERM');
  const second = await gone;
  assert.equal(second.code, 128 + 15);
});
