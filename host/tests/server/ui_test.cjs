// The built-in chat page in headless Chromium: type a message, see a reply
// stream in, press Stop, check the server freed the slot, then chat once more.
// Usage: PULSAR_SERVER_URL=... PULSAR_API_KEY=... PULSAR_E2E_ARTIFACTS=DIR node ui_test.cjs
"use strict";
const { chromium } = require("playwright-core");
const path = require("path");

const URL = process.env.PULSAR_SERVER_URL.replace(/\/$/, "");
const KEY = process.env.PULSAR_API_KEY || "";
const ART = process.env.PULSAR_E2E_ARTIFACTS || ".";
const auth = KEY ? { Authorization: "Bearer " + KEY } : {};

function check(cond, what) {
  if (!cond) throw new Error("FAIL: " + what);
  console.log("ok: " + what);
}

async function api(p, body) {
  const r = await fetch(URL + p, {
    method: body ? "POST" : "GET",
    headers: { "Content-Type": "application/json", ...auth },
    body: body ? JSON.stringify(body) : undefined,
  });
  const j = await r.json();
  if (!r.ok) throw new Error(p + ": " + JSON.stringify(j));
  return j;
}

// A message whose greedy reply runs long (the test model's text is noise and
// some replies stop at once), so Stop lands mid-stream.
async function longMessage() {
  for (let k = 0; k < 40; k++) {
    const m = "Write a long story about a dragon who learns to bake bread, part " + (k + 1) + ".";
    const j = await api("/v1/chat/completions", { messages: [{ role: "user", content: m }], max_tokens: 96, temperature: 0 });
    if (j.choices[0].finish_reason === "length") return m;
  }
  throw new Error("no message of 40 gets a long reply");
}

async function main() {
  const message = await longMessage();
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1200, height: 800 } });
    page.on("pageerror", (e) => { console.error("page error: " + e); process.exitCode = 1; });
    await page.goto(URL + "/");
    await page.fill("#apikey", KEY);
    await page.dispatchEvent("#apikey", "change");
    await page.waitForFunction(() => /^model: gemma/.test(document.getElementById("model").textContent), null, { timeout: 10000 });
    check(true, "the page names the served model once the key is entered");
    await page.fill("#temperature", "0");
    await page.fill("#max_tokens", "3500");
    await page.fill("#system", "");
    await page.fill("#input", message);
    await page.click("#send");
    const body = page.locator(".msg.assistant .body").last();
    await page.waitForFunction(() => { const b = document.querySelectorAll(".msg.assistant .body"); return b.length && b[b.length - 1].textContent.length > 0; }, null, { timeout: 30000 });
    const first = (await body.textContent()).length;
    const grown = Math.max(first, 60);
    await page.waitForFunction((n) => { const b = document.querySelectorAll(".msg.assistant .body"); return b[b.length - 1].textContent.length > n; }, grown, { timeout: 60000 });
    check(true, "the reply streams in (" + first + " characters, then past " + grown + ")");
    check(await page.isEnabled("#stop") && !(await page.isEnabled("#send")), "Stop is live while streaming");
    check(/tok\/s/.test(await page.textContent("#status")), "tok/s is shown while streaming");
    await page.click("#stop");
    await page.waitForSelector(".msg.assistant[data-state]:not([data-state=streaming])", { timeout: 10000 });
    const state = await page.locator(".msg.assistant").last().getAttribute("data-state");
    check(state === "stopped", "Stop ends the stream (state " + state + ")");
    const stoppedAt = (await body.textContent()).length;
    await page.waitForTimeout(300);
    check((await body.textContent()).length === stoppedAt, "no text arrives after Stop");
    await page.screenshot({ path: path.join(ART, "ui-stopped.png"), fullPage: true });
    // The server noticed the disconnect and freed the slot.
    let m;
    for (let i = 0; i < 100; i++) {
      m = await api("/metrics?format=json");
      if (m.active_sequences === 0 && m.requests_cancelled >= 1) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    check(m.active_sequences === 0 && m.requests_cancelled >= 1, "the server freed the stopped generation's slot: " + JSON.stringify(m));
    // A second turn completes (and reuses the conversation's cached prefix).
    await page.fill("#max_tokens", "8");
    await page.fill("#input", "And then?");
    await page.click("#send");
    await page.waitForFunction(() => { const m = document.querySelectorAll(".msg.assistant"); return m.length === 2 && m[1].dataset.state !== "streaming"; }, null, { timeout: 30000 });
    const state2 = await page.locator(".msg.assistant").last().getAttribute("data-state");
    const status = await page.textContent("#status");
    check(state2 === "done" && /done/.test(status) && /tok\/s/.test(status), "a second turn completes: " + status);
    check(/cached/.test(status) && !/\(0 cached\)/.test(status), "the second turn reused the cached prefix: " + status);
    await page.screenshot({ path: path.join(ART, "ui-second-turn.png"), fullPage: true });
    console.log("ui tests passed; screenshots in " + ART);
  } finally {
    await browser.close();
  }
}

main().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
