// The OpenAI API fields agents and evaluation tools use, through the official
// Node SDK, against `dflash serve` on the bundled pair with DFlash on and off:
// tool calls and reasoning_content (streamed and not), logprobs, n, penalties,
// logit_bias, min_tokens, ignore_eos, /tokenize and /detokenize. Every request
// is sent to both servers and must get the same answer (DFlash is lossless),
// and a streamed answer must equal the non-streamed one.
//
// The bundled model writes Python, not tool calls: the chat tests give it a
// conversation whose earlier assistant turns hold a think block and a tool
// call, which it copies, under a template whose generation prompt opens a
// think block (tests/server/thinking_template.jinja, as Qwen3-Thinking's does).
//
// Run: DFLASH_BINARY=build/dflash node --test tests/server/api_fields.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';

const BIN = process.env.DFLASH_BINARY ?? 'build/dflash';
const MODEL = 'pycoder-16m';
const TEMPLATE = path.join(path.dirname(fileURLToPath(import.meta.url)), 'thinking_template.jinja');
const PROMPT = 'def fibonacci(n):';

function startServer(args) {
  return new Promise((resolve, reject) => {
    const proc = spawn(BIN, ['serve', '--port', '0', '--chat-template', TEMPLATE, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
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

const servers = {};
const clients = {};
before(async () => {
  servers.dflash = await startServer([]);
  servers.plain = await startServer(['--speculative', 'none']);
  for (const [k, s] of Object.entries(servers))
    clients[k] = new OpenAI({ baseURL: `${s.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 600000 });
});
after(() => { for (const s of Object.values(servers)) s.proc.kill('SIGTERM'); });

// Runs `fn(client, name)` on both servers and requires equal results.
async function both(fn, what) {
  const d = await fn(clients.dflash, 'dflash');
  const p = await fn(clients.plain, 'plain');
  assert.deepEqual(d, p, `${what}: DFlash differs from plain decoding`);
  return d;
}

// A streamed completion or chat completion folded into the shape of a non-streamed one.
async function collect(stream, chat) {
  const choices = [];
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      const o = choices[c.index] ??= { index: c.index, text: '', content: '', reasoning: '', calls: [], logprobs: [],
                                       finish_reason: null };
      if (c.finish_reason) o.finish_reason = c.finish_reason;
      if (!chat) {
        o.text += c.text;
        if (c.logprobs) o.logprobs.push(...c.logprobs.token_logprobs);
        continue;
      }
      const d = c.delta ?? {};
      o.content += d.content ?? '';
      o.reasoning += d.reasoning_content ?? '';
      if (c.logprobs?.content) o.logprobs.push(...c.logprobs.content.map((e) => e.logprob));
      for (const tc of d.tool_calls ?? []) {
        const call = o.calls[tc.index] ??= { id: '', name: '', arguments: '' };
        if (tc.id) call.id = tc.id;
        if (tc.function?.name) {
          assert.equal(call.arguments, '', 'a tool call streams its name before its arguments');
          call.name = tc.function.name;
        }
        call.arguments += tc.function?.arguments ?? '';
      }
    }
  }
  return { choices, usage };
}

// --- tool calls and reasoning ---

const TOOLS = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
                                  parameters: { type: 'object', properties: { city: { type: 'string' } } } } },
  { type: 'function', function: { name: 'get_time', parameters: { type: 'object' } } },
];
const TURN = 'I should call the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>';
function agentMessages() {
  const m = [];
  for (let i = 0; i < 4; ++i) m.push({ role: 'user', content: 'weather?' }, { role: 'assistant', content: `<think>\n${TURN}` });
  m.push({ role: 'user', content: 'weather?' });
  return m;
}
const AGENT = { model: MODEL, messages: agentMessages(), tools: TOOLS, max_tokens: 80, stop: ['<|im_end|>'] };

test('tool calls and reasoning_content, streamed or not, DFlash == plain', async () => {
  const withoutIds = (choice) => {  // ids are random per response
    for (const c of choice.message.tool_calls ?? []) assert.match(c.id, /^call_/), c.id = 'call';
    return choice;
  };
  const message = await both(async (c) => withoutIds((await c.chat.completions.create(AGENT)).choices[0]), 'tool call');
  assert.equal(message.finish_reason, 'tool_calls');
  assert.equal(message.message.reasoning_content, 'I should call the weather tool.');
  assert.equal(message.message.content, null);
  assert.equal(message.message.tool_calls.length, 1);
  const call = message.message.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris' });
  for (const [name, client] of Object.entries(clients)) {
    const s = (await collect(await client.chat.completions.create({ ...AGENT, stream: true }), true)).choices[0];
    assert.equal(s.finish_reason, 'tool_calls', name);
    assert.equal(s.reasoning, message.message.reasoning_content, name);
    assert.equal(s.content, '', name);
    assert.deepEqual(s.calls.map((c) => [c.name, c.arguments]), [[call.function.name, call.function.arguments]], name);
  }
  // A follow-up turn with the tool's answer renders (tool role, assistant tool_calls).
  const follow = await clients.dflash.chat.completions.create({
    ...AGENT, max_tokens: 8,
    messages: [...AGENT.messages, { role: 'assistant', content: null, tool_calls: message.message.tool_calls },
               { role: 'tool', tool_call_id: call.id, content: '18 C' }],
  });
  assert.ok(follow.choices[0].message);
});

test('tool_choice and parallel_tool_calls', async () => {
  const none = await both(async (c) => (await c.chat.completions.create({ ...AGENT, tool_choice: 'none' })).choices[0], 'none');
  assert.equal(none.message.tool_calls, undefined);
  assert.notEqual(none.finish_reason, 'tool_calls');
  const single = await clients.dflash.chat.completions.create({ ...AGENT, parallel_tool_calls: false });
  assert.equal(single.choices[0].message.tool_calls.length, 1);
  for (const tool_choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
    await assert.rejects(clients.dflash.chat.completions.create({ ...AGENT, tool_choice }), (e) => {
      assert.equal(e.status, 400);
      assert.equal(e.param, 'tool_choice');
      assert.match(e.message, /constrained decoding/);
      return true;
    });
  }
  // A call to a function the request does not offer stays text.
  const unknown = await clients.dflash.chat.completions.create({ ...AGENT, tools: [TOOLS[1]] });
  assert.equal(unknown.choices[0].message.tool_calls, undefined);
  assert.match(unknown.choices[0].message.content, /<tool_call>/);
});

// --- logprobs ---

test('logprobs: completions (integer) and chat (top_logprobs), streamed or not, DFlash == plain', async () => {
  const r = await both(async (c) => {
    const x = await c.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 24, logprobs: 3 });
    return x.choices[0];
  }, 'completion logprobs');
  const lp = r.logprobs;
  assert.equal(lp.tokens.length, 24);
  assert.equal(lp.tokens.join(''), r.text);
  assert.equal(lp.token_logprobs.length, 24);
  for (let i = 0; i < 24; ++i) {
    assert.ok(lp.token_logprobs[i] <= 0);
    const top = Object.values(lp.top_logprobs[i]);
    assert.ok(top.length >= 1 && top.length <= 3);
    assert.equal(Math.max(...top), lp.token_logprobs[i], 'greedy: the chosen token is the most likely');
  }
  for (const [name, client] of Object.entries(clients)) {
    const s = await collect(await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 24, logprobs: 3,
                                                               stream: true }), false);
    assert.deepEqual(s.choices[0].logprobs, lp.token_logprobs, name);
  }
  const chatParams = { model: MODEL, messages: [{ role: 'user', content: 'Write a sum function.' }], max_tokens: 16,
                       logprobs: true, top_logprobs: 2, temperature: 0.7, seed: 3 };
  const chat = await both(async (c) => (await c.chat.completions.create(chatParams)).choices[0].logprobs.content, 'chat logprobs');
  assert.equal(chat.length, 16);
  for (const e of chat) {
    assert.equal(typeof e.token, 'string');
    assert.ok(Array.isArray(e.bytes));
    assert.equal(e.top_logprobs.length, 2);
  }
  const s = await collect(await clients.dflash.chat.completions.create({ ...chatParams, stream: true }), true);
  assert.deepEqual(s.choices[0].logprobs, chat.map((e) => e.logprob));
  await assert.rejects(clients.dflash.chat.completions.create({ ...chatParams, top_logprobs: 21 }), (e) => e.status === 400);
});

// --- n ---

test('n choices each equal one request with seed + i, streamed or not, DFlash == plain', async () => {
  const params = { model: MODEL, prompt: PROMPT, max_tokens: 20, temperature: 0.9, seed: 40 };
  const texts = await both(async (c) => (await c.completions.create({ ...params, n: 3 })).choices.map((x) => x.text), 'n = 3');
  assert.equal(texts.length, 3);
  for (let i = 0; i < 3; ++i) {
    const alone = await clients.plain.completions.create({ ...params, seed: 40 + i });
    assert.equal(texts[i], alone.choices[0].text, `choice ${i}`);
  }
  assert.ok(new Set(texts).size > 1, 'the choices differ');
  const s = await collect(await clients.dflash.completions.create({ ...params, n: 3, stream: true,
                                                                    stream_options: { include_usage: true } }), false);
  assert.deepEqual(s.choices.map((c) => c.text), texts);
  assert.equal(s.usage.completion_tokens, 60);
  const chat = await clients.dflash.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'hi' }],
                                                             max_tokens: 8, n: 2, temperature: 1, seed: 1 });
  assert.equal(chat.choices.length, 2);
  assert.deepEqual(chat.choices.map((c) => c.index), [0, 1]);
});

// --- penalties, logit_bias, min_tokens, ignore_eos ---

test('penalties, logit_bias, min_tokens and ignore_eos, greedy and sampled, streamed or not, DFlash == plain', async () => {
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 32 };
  const plainText = (await clients.plain.completions.create(base)).choices[0].text;
  const settings = {
    presence_penalty: { presence_penalty: 2 },
    frequency_penalty: { frequency_penalty: 2 },
    repetition_penalty: { repetition_penalty: 1.8 },
    logit_bias: { logit_bias: { 29: -100, 93: 5 } },
    combined: { presence_penalty: 0.5, frequency_penalty: 0.5, repetition_penalty: 1.2, min_tokens: 4 },
  };
  let changed = 0;
  for (const [name, extra] of Object.entries(settings)) {
    for (const sampling of [{}, { temperature: 0.8, seed: 9 }]) {
      const params = { ...base, ...extra, ...sampling };
      const text = await both(async (c) => (await c.completions.create(params)).choices[0].text, name);
      const s = await collect(await clients.dflash.completions.create({ ...params, stream: true }), false);
      assert.equal(s.choices[0].text, text, `${name}: streamed`);
      if (!sampling.seed && text !== plainText) ++changed;
    }
  }
  assert.ok(changed >= 3, `only ${changed} settings changed the greedy text`);
  // A forcing bias: token 29 ('<' in the bundled tokenizer) every time.
  const forced = await both(async (c) => (await c.completions.create({ ...base, max_tokens: 6, temperature: 1, seed: 2,
                                                                       logit_bias: { 29: 100 } })).choices[0].text, 'forced');
  const [tok] = (await (await fetch(`${servers.dflash.url}/detokenize`, { method: 'POST',
                                    body: JSON.stringify({ tokens: [29] }) })).json()).prompt;
  assert.equal(forced, tok.repeat(6));
  // ignore_eos runs to max_tokens; min_tokens holds EOS back (EOS = <|endoftext|>).
  const chat = { model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 40 };
  const full = await both(async (c) => {
    const { choices, usage } = await c.chat.completions.create({ ...chat, ignore_eos: true });
    return { choices, usage };
  }, 'ignore_eos');
  assert.equal(full.usage.completion_tokens, 40);
  assert.equal(full.choices[0].finish_reason, 'length');
  const min = await both(async (c) => (await c.chat.completions.create({ ...chat, min_tokens: 30 })).usage.completion_tokens, 'min_tokens');
  assert.ok(min >= 30);
  for (const bad of [{ presence_penalty: 2.5 }, { logit_bias: { 'x': 1 } }, { logit_bias: { 5: 101 } },
                     { repetition_penalty: -1 }, { min_tokens: 33 }, { n: 0 }]) {
    await assert.rejects(clients.dflash.completions.create({ ...base, ...bad }), (e) => {
      assert.equal(e.status, 400, JSON.stringify(bad));
      assert.equal(e.param, Object.keys(bad)[0]);
      return true;
    });
  }
});

// --- /tokenize and /detokenize ---

test('/tokenize and /detokenize as vLLM names them', async () => {
  const post = async (p, body) => (await fetch(`${servers.dflash.url}${p}`, { method: 'POST', body: JSON.stringify(body) }));
  const t = await (await post('/tokenize', { model: MODEL, prompt: PROMPT })).json();
  assert.equal(t.count, t.tokens.length);
  assert.ok(t.max_model_len > 0);
  const d = await (await post('/detokenize', { model: MODEL, tokens: t.tokens })).json();
  assert.equal(d.prompt, PROMPT);
  const r = await clients.dflash.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 1 });
  assert.equal(r.usage.prompt_tokens, t.count);
  const chat = await (await post('/tokenize', { messages: [{ role: 'user', content: 'hi' }], return_token_strs: true })).json();
  assert.equal(chat.token_strs.join(''), '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n');
  assert.equal((await post('/detokenize', { tokens: [1e9] })).status, 400);
});
