#!/usr/bin/env node
// Serving sweep: starts `dflash serve` twice (baseline --speculative none, and
// DFlash), sends a prompt set at each concurrency with streaming requests, and
// prints concurrency x {baseline, dflash} x {output tok/s, TTFT, TPOT, tau,
// speedup}, like SGLang's DFlash sweep; --json writes the rows with settings.
// Needs only Node.js (built-in fetch).
//
//   node tools/bench_serving.mjs --dflash build/dflash --data bench/data/humaneval.jsonl \
//        --n 32 --concurrency 1,4,16 --max-tokens 128 [--mode completion|chat] \
//        [--server-args "--model DIR --draft DIR"] [--json out.json]
//
// Prompt sets are JSONL rows with "turns" (the first turn is used). completion
// mode sends the code inside the turn's ``` fence (or the whole turn) to
// /v1/completions; chat mode sends the turn as a user message.
import { spawn } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';

function parseArgs() {
  const a = { dflash: 'build/dflash', data: 'bench/data/humaneval.jsonl', n: 32, concurrency: '1,4,16',
              'max-tokens': 128, mode: 'completion', 'server-args': '', json: '' };
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) {
    const k = argv[i].replace(/^--/, '');
    if (!(k in a)) throw new Error(`unknown option ${argv[i]}`);
    a[k] = argv[i + 1];
  }
  a.n = Number(a.n);
  a['max-tokens'] = Number(a['max-tokens']);
  a.concurrency = a.concurrency.split(',').map(Number);
  return a;
}

function loadPrompts(file, n, mode) {
  const rows = readFileSync(file, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
  return rows.slice(0, n).map((r) => {
    const turn = r.turns[0];
    if (mode === 'chat') return turn;
    const m = turn.match(/```(?:python)?\n([\s\S]*?)```/);
    return m ? m[1] : turn;
  });
}

function startServer(bin, args) {
  return new Promise((resolve, reject) => {
    const proc = spawn(bin, ['serve', '--port', '0', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/'([^']+)' at (http:\/\/[^\s]+)\/v1/);
      if (m) resolve({ proc, model: m[1], url: m[2], log: out });
    });
    proc.stderr.on('data', (d) => { out += d; });
    proc.on('exit', (code) => reject(new Error(`server exited with ${code}: ${out}`)));
  });
}

async function scrape(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const get = (name) => Number((text.split('\n').find((l) => l.startsWith(name + ' ')) ?? '0 0').split(' ').pop());
  return { accSum: get('dflash_acceptance_length_sum'), accCount: get('dflash_acceptance_length_count') };
}

// One streaming request: returns {tokens, ttft, tpot} (seconds).
async function request(server, prompt, maxTokens, mode) {
  const chat = mode === 'chat';
  const body = { model: server.model, max_tokens: maxTokens, stream: true, stream_options: { include_usage: true } };
  if (chat) body.messages = [{ role: 'user', content: prompt }];
  else body.prompt = prompt;
  const t0 = performance.now();
  const res = await fetch(`${server.url}/v1/${chat ? 'chat/completions' : 'completions'}`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
  if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let first = 0, last = 0, usage = null, buf = '';
  const decoder = new TextDecoder();
  for await (const part of res.body) {
    buf += decoder.decode(part, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
      const j = JSON.parse(ev.slice(6));
      if (j.usage) usage = j.usage;
      const c = j.choices[0];
      if (c && (c.text || c.delta?.content)) {
        last = performance.now();
        if (!first) first = last;
      }
    }
  }
  const tokens = usage.completion_tokens;
  return { tokens, ttft: (first - t0) / 1000, tpot: tokens > 1 ? (last - first) / 1000 / (tokens - 1) : 0 };
}

async function sweepOne(server, prompts, c, maxTokens, mode) {
  const before = await scrape(server.url);
  const results = [];
  let next = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: c }, async () => {
    while (next < prompts.length) results.push(await request(server, prompts[next++], maxTokens, mode));
  }));
  const wall = (performance.now() - t0) / 1000;
  const after = await scrape(server.url);
  const tokens = results.reduce((s, r) => s + r.tokens, 0);
  const mean = (f) => results.reduce((s, r) => s + f(r), 0) / results.length;
  const steps = after.accCount - before.accCount;
  return { output_tok_s: tokens / wall, ttft_ms: 1000 * mean((r) => r.ttft), tpot_ms: 1000 * mean((r) => r.tpot),
           tau: steps > 0 ? (after.accSum - before.accSum) / steps : 1, tokens, wall_s: wall };
}

const a = parseArgs();
const prompts = loadPrompts(a.data, a.n, a.mode);
const extra = a['server-args'] ? a['server-args'].split(/\s+/) : [];
const maxSeqs = String(Math.max(...a.concurrency));
const rows = [];
for (const variant of ['baseline', 'dflash']) {
  const args = [...extra, '--max-num-seqs', maxSeqs, ...(variant === 'baseline' ? ['--speculative', 'none'] : [])];
  const server = await startServer(a.dflash, args);
  process.stderr.write(server.log);
  try {
    await request(server, prompts[0], 8, a.mode);  // warm-up
    for (const c of a.concurrency) {
      const r = await sweepOne(server, prompts, c, a['max-tokens'], a.mode);
      rows.push({ variant, concurrency: c, ...r });
      process.stderr.write(`${variant} c=${c}: ${r.output_tok_s.toFixed(1)} tok/s\n`);
    }
  } finally {
    server.proc.kill('SIGTERM');
  }
}
console.log('concurrency | variant  | output tok/s | TTFT ms | TPOT ms | tau  | speedup');
for (const c of a.concurrency) {
  const base = rows.find((r) => r.variant === 'baseline' && r.concurrency === c);
  for (const r of rows.filter((x) => x.concurrency === c)) {
    r.speedup = r.output_tok_s / base.output_tok_s;
    console.log(`${String(c).padStart(11)} | ${r.variant.padEnd(8)} | ${r.output_tok_s.toFixed(1).padStart(12)} | ` +
                `${r.ttft_ms.toFixed(1).padStart(7)} | ${r.tpot_ms.toFixed(2).padStart(7)} | ${r.tau.toFixed(2)} | ` +
                `${r.speedup.toFixed(2)}x`);
  }
}
if (a.json) {
  writeFileSync(a.json, JSON.stringify({ settings: { data: a.data, n: a.n, max_tokens: a['max-tokens'], mode: a.mode,
    server_args: a['server-args'], concurrency: a.concurrency }, rows }, null, 2) + '\n');
}
