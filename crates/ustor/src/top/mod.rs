//! `ustor top`: a live view of a running server over its RPC socket, like
//! `spdk_top` or `htop`. [`model`] turns two samples of the stats RPCs into
//! rates; [`ui`] draws them (ratatui on crossterm); this module runs the
//! sampling loop, the terminal, and `--once [--json]` for scripts.

pub mod model;
pub mod ui;

use std::io;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use crossterm::terminal::{self, EnterAlternateScreen, LeaveAlternateScreen};
use ratatui::backend::{CrosstermBackend, TestBackend};
use ratatui::Terminal;
use serde_json::Value;
use ustor_rpc::RpcClient;

use model::{Sample, View};
use ui::{Action, Screen, SortKey};

#[derive(clap::Args)]
pub struct TopArgs {
    /// RPC socket of the server.
    #[arg(short = 's', long = "server", default_value = crate::rpc_cmd::DEFAULT_SOCKET)]
    socket: String,
    /// Refresh interval in seconds.
    #[arg(short = 'd', long = "delay", default_value_t = 1.0)]
    delay: f64,
    /// Take one interval, print it and exit (a text screen, or JSON with --json).
    #[arg(long)]
    once: bool,
    /// With --once: print the rates as JSON.
    #[arg(long, requires = "once")]
    json: bool,
    /// Initial sort column: name, iops, bw, latency or qd.
    #[arg(long, default_value = "iops")]
    sort: String,
}

/// The server's RPC connection, reopened when it breaks (server restart).
struct Source {
    path: String,
    client: Option<RpcClient>,
    start: Instant,
}

impl Source {
    fn sample(&mut self) -> Result<Sample, String> {
        if self.client.is_none() {
            let mut c = RpcClient::connect(&self.path).map_err(|e| e.message)?;
            c.set_timeout(Duration::from_secs(5));
            self.client = Some(c);
        }
        let at = self.start.elapsed().as_secs_f64();
        let client = self.client.as_mut().expect("connected above");
        // Every server answers this one: its failure means the connection
        // broke (server restarted), and the next sample reconnects.
        let reactors = match client.call("framework_get_reactors", Value::Null) {
            Ok(v) => v,
            Err(e) => {
                self.client = None;
                return Err(e.message);
            }
        };
        // Other errors are answers (a target not started): no row for it.
        let s = Sample::from_rpc(at, |m| match m {
            "framework_get_reactors" => Some(reactors.clone()),
            _ => client.call(m, Value::Null).ok(),
        });
        Ok(s)
    }
}

fn sort_key(s: &str) -> Result<SortKey, String> {
    Ok(match s {
        "name" => SortKey::Name,
        "iops" => SortKey::Iops,
        "bw" | "mibs" => SortKey::Bandwidth,
        "latency" | "lat" => SortKey::Latency,
        "qd" => SortKey::QueueDepth,
        _ => {
            return Err(format!(
                "unknown sort column `{s}` (name, iops, bw, latency, qd)"
            ))
        }
    })
}

pub fn run(a: TopArgs) -> i32 {
    let sort = match sort_key(&a.sort) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("ustor top: {e}");
            return 2;
        }
    };
    if !(a.delay.is_finite() && a.delay >= 0.1) {
        eprintln!("ustor top: -d must be at least 0.1 seconds");
        return 2;
    }
    let mut src = Source {
        path: a.socket.clone(),
        client: None,
        start: Instant::now(),
    };
    let screen = Screen {
        sort,
        reverse: false,
        interval_s: a.delay,
        socket: a.socket.clone(),
        status: String::new(),
    };
    let r = if a.once {
        once(&mut src, &a, &screen)
    } else {
        live(&mut src, screen)
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ustor top: {e}");
            1
        }
    }
}

/// One interval, printed.
fn once(src: &mut Source, a: &TopArgs, screen: &Screen) -> Result<(), String> {
    let first = src.sample()?;
    std::thread::sleep(Duration::from_secs_f64(a.delay));
    let second = src.sample()?;
    let view = View::between(&first, &second);
    if a.json {
        let v = serde_json::to_value(&view).map_err(|e| e.to_string())?;
        println!("{}", ustor_rpc::to_pretty(&v));
        return Ok(());
    }
    let (w, h) = terminal::size().unwrap_or((80, 24));
    let mut t = Terminal::new(TestBackend::new(w, h)).map_err(|e| e.to_string())?;
    t.draw(|f| ui::draw(f, Some(&view), screen))
        .map_err(|e| e.to_string())?;
    let buf = t.backend().buffer();
    for y in 0..buf.area.height {
        let line: String = (0..buf.area.width).map(|x| buf[(x, y)].symbol()).collect();
        println!("{}", line.trim_end());
    }
    Ok(())
}

/// Restores the terminal when dropped, panics included.
struct TermGuard;

impl Drop for TermGuard {
    fn drop(&mut self) {
        let _ = terminal::disable_raw_mode();
        let _ = crossterm::execute!(io::stdout(), LeaveAlternateScreen, crossterm::cursor::Show);
    }
}

/// The full-screen loop: sample every interval, redraw on data, keys and
/// resizes, quit on `q`, Esc or Ctrl-C.
fn live(src: &mut Source, mut screen: Screen) -> Result<(), String> {
    let io_err = |e: io::Error| e.to_string();
    terminal::enable_raw_mode().map_err(io_err)?;
    let _guard = TermGuard;
    // Release builds abort on panic (no unwinding, so no guard): restore
    // the terminal before the message is printed.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        drop(TermGuard);
        default_hook(info);
    }));
    crossterm::execute!(io::stdout(), EnterAlternateScreen).map_err(io_err)?;
    let mut term = Terminal::new(CrosstermBackend::new(io::stdout())).map_err(io_err)?;
    let mut prev: Option<Sample> = None;
    let mut view: Option<View> = None;
    let mut next = Instant::now();
    loop {
        if Instant::now() >= next {
            match src.sample() {
                Ok(s) => {
                    if let Some(p) = &prev {
                        view = Some(View::between(p, &s));
                    }
                    prev = Some(s);
                    screen.status.clear();
                }
                Err(e) => screen.status = format!("RPC: {e}"),
            }
            next = Instant::now() + Duration::from_secs_f64(screen.interval_s);
        }
        term.draw(|f| ui::draw(f, view.as_ref(), &screen))
            .map_err(io_err)?;
        let wait = next.saturating_duration_since(Instant::now());
        if !event::poll(wait).map_err(io_err)? {
            continue;
        }
        let Event::Key(k) = event::read().map_err(io_err)? else {
            continue; // a resize: redraw
        };
        if k.kind != KeyEventKind::Press {
            continue;
        }
        let act = match k.code {
            KeyCode::Esc => Action::Quit,
            KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
            KeyCode::Char(c) => ui::action(c),
            _ => Action::None,
        };
        match act {
            Action::Quit => return Ok(()),
            Action::Sort(key) => screen.sort = key,
            Action::NextSort => screen.sort = screen.sort.next(),
            Action::Reverse => screen.reverse = !screen.reverse,
            Action::Interval(x) => {
                screen.interval_s = (screen.interval_s * x).clamp(0.1, 60.0);
                next = Instant::now() + Duration::from_secs_f64(screen.interval_s);
            }
            Action::None => {}
        }
    }
}
