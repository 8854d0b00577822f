//! `ustor top`'s screen: draws a [`View`] with ratatui (reactors, bdevs,
//! targets, connections, one section each) and maps keys to actions. The
//! layout fits 80x24: sections shrink to what is left, bdevs first.

use std::cmp::Ordering;

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table};
use ratatui::Frame;

use super::model::{BdevRow, ConnRow, View};

/// The column bdevs (and connections) are sorted by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    Name,
    Iops,
    Bandwidth,
    Latency,
    QueueDepth,
}

impl SortKey {
    const ALL: [SortKey; 5] = [
        SortKey::Name,
        SortKey::Iops,
        SortKey::Bandwidth,
        SortKey::Latency,
        SortKey::QueueDepth,
    ];

    fn label(self) -> &'static str {
        match self {
            SortKey::Name => "name",
            SortKey::Iops => "IOPS",
            SortKey::Bandwidth => "MiB/s",
            SortKey::Latency => "latency",
            SortKey::QueueDepth => "queue depth",
        }
    }

    pub fn next(self) -> SortKey {
        let i = SortKey::ALL.iter().position(|k| *k == self).unwrap_or(0);
        SortKey::ALL[(i + 1) % SortKey::ALL.len()]
    }
}

/// What a key press asks for.
#[derive(Debug, PartialEq)]
pub enum Action {
    Quit,
    Sort(SortKey),
    NextSort,
    Reverse,
    /// Refresh interval times this factor.
    Interval(f64),
    None,
}

/// The key bindings (shown on the screen's last line).
pub fn action(c: char) -> Action {
    match c {
        'q' | 'Q' => Action::Quit,
        'n' => Action::Sort(SortKey::Name),
        'i' => Action::Sort(SortKey::Iops),
        'b' => Action::Sort(SortKey::Bandwidth),
        'l' => Action::Sort(SortKey::Latency),
        'd' => Action::Sort(SortKey::QueueDepth),
        's' => Action::NextSort,
        'r' => Action::Reverse,
        '+' => Action::Interval(2.0),
        '-' => Action::Interval(0.5),
        _ => Action::None,
    }
}

/// What the screen shows besides the data.
pub struct Screen {
    pub sort: SortKey,
    pub reverse: bool,
    pub interval_s: f64,
    pub socket: String,
    pub status: String,
}

fn bdev_key(b: &BdevRow, k: SortKey) -> f64 {
    match k {
        SortKey::Name => 0.0,
        SortKey::Iops => b.iops,
        SortKey::Bandwidth => b.read_mib_s + b.write_mib_s,
        SortKey::Latency => b.avg_lat_us,
        SortKey::QueueDepth => b.queue_depth,
    }
}

/// Sorts bdevs: by name ascending, numbers descending (busiest first);
/// `reverse` flips either.
pub fn sort_bdevs(rows: &mut [BdevRow], k: SortKey, reverse: bool) {
    rows.sort_by(|a, b| {
        let o = match k {
            SortKey::Name => a.name.cmp(&b.name),
            _ => bdev_key(b, k)
                .partial_cmp(&bdev_key(a, k))
                .unwrap_or(Ordering::Equal)
                .then_with(|| a.name.cmp(&b.name)),
        };
        if reverse {
            o.reverse()
        } else {
            o
        }
    });
}

fn sort_conns(rows: &mut [ConnRow], k: SortKey, reverse: bool) {
    rows.sort_by(|a, b| {
        let o = match k {
            SortKey::Name => (&a.target, &a.peer, &a.queue).cmp(&(&b.target, &b.peer, &b.queue)),
            SortKey::QueueDepth => b.outstanding.cmp(&a.outstanding),
            _ => (b.iops, b.pdus_per_s)
                .partial_cmp(&(a.iops, a.pdus_per_s))
                .unwrap_or(Ordering::Equal),
        };
        if reverse {
            o.reverse()
        } else {
            o
        }
    });
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

/// Header cells, the sorted one marked with `*`.
fn header(cols: &[(&str, Option<SortKey>)], s: &Screen) -> Row<'static> {
    let cells: Vec<String> = cols
        .iter()
        .map(|(name, k)| {
            if *k == Some(s.sort) {
                format!("{name}*")
            } else {
                name.to_string()
            }
        })
        .collect();
    Row::new(cells).style(Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED))
}

fn section(title: String) -> Block<'static> {
    Block::default().borders(Borders::TOP).title(title)
}

/// Draws the whole screen.
pub fn draw(f: &mut Frame, view: Option<&View>, s: &Screen) {
    let area = f.area();
    let Some(v) = view else {
        let p = Paragraph::new(format!(
            "ustor top: {}\n{}\ncollecting the first interval ({:.1} s)...",
            s.socket, s.status, s.interval_s
        ));
        f.render_widget(p, area);
        return;
    };
    let mut bdevs = v.bdevs.clone();
    sort_bdevs(&mut bdevs, s.sort, s.reverse);
    let mut conns = v.connections.clone();
    sort_conns(&mut conns, s.sort, s.reverse);
    // Each section: a title line and a header, then rows.
    let want = |n: usize| (n + 2) as u16;
    let fixed = 2; // status line + key line
    let avail = area.height.saturating_sub(fixed);
    let r_h = want(v.reactors.len()).min(avail / 4).max(3);
    let t_h = want(v.targets.len()).min(5);
    let b_h = want(bdevs.len())
        .min(avail.saturating_sub(r_h + t_h + 3))
        .max(3);
    let chunks = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(r_h),
        Constraint::Length(b_h),
        Constraint::Length(t_h),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .split(area);
    let order = if s.reverse { " reversed" } else { "" };
    // What changes first: a long socket path is what gets cut at 80 columns.
    let top = format!(
        "ustor top  sort: {}{}  every {:.1}s  {}  {}",
        s.sort.label(),
        order,
        s.interval_s,
        s.status,
        s.socket
    );
    f.render_widget(Paragraph::new(Line::from(top)), chunks[0]);
    reactors(f, chunks[1], v, s);
    bdev_table(f, chunks[2], &bdevs, s);
    targets(f, chunks[3], v, s);
    conn_table(f, chunks[4], &conns, s);
    let keys = "q quit  s/n/i/b/l/d sort  r reverse  +/- interval";
    f.render_widget(Paragraph::new(Line::from(keys)), chunks[5]);
}

fn reactors(f: &mut Frame, a: Rect, v: &View, s: &Screen) {
    let rows = v.reactors.iter().map(|r| {
        Row::new(vec![
            r.lcore.to_string(),
            r.poll_mode.clone(),
            format!("{:.1}", r.busy_pct),
            format!("{:.0}", r.loops_per_s),
            format!("{:.0}", r.sleeps_per_s),
            format!("{:.0}", r.wakeups_per_s),
            r.tasks.to_string(),
        ])
    });
    let w = [5, 9, 7, 10, 9, 9, 6].map(Constraint::Length);
    let cols = [
        ("core", None),
        ("mode", None),
        ("busy%", None),
        ("loops/s", None),
        ("sleeps/s", None),
        ("wakes/s", None),
        ("tasks", None),
    ];
    let t = Table::new(rows, w)
        .header(header(&cols, s))
        .block(section(format!(" reactors ({}) ", v.reactors.len())));
    f.render_widget(t, a);
}

fn bdev_table(f: &mut Frame, a: Rect, bdevs: &[BdevRow], s: &Screen) {
    let rows = bdevs.iter().map(|b| {
        Row::new(vec![
            b.name.clone(),
            format!("{:.0}", b.iops),
            format!("{:.0}", b.read_iops),
            format!("{:.0}", b.write_iops),
            format!("{:.1}", b.read_mib_s + b.write_mib_s),
            format!("{:.1}", b.avg_lat_us),
            opt(b.worst(false), 1),
            opt(b.worst(true), 1),
            format!("{:.1}", b.queue_depth),
        ])
    });
    // 78 columns with the spacing: an 80-column terminal, borders included.
    let w = [13, 8, 8, 8, 7, 7, 7, 7, 5].map(Constraint::Length);
    let cols = [
        ("bdev", Some(SortKey::Name)),
        ("IOPS", Some(SortKey::Iops)),
        ("read/s", None),
        ("write/s", None),
        ("MiB/s", Some(SortKey::Bandwidth)),
        ("lat us", Some(SortKey::Latency)),
        ("p50", None),
        ("p99", None),
        ("QD", Some(SortKey::QueueDepth)),
    ];
    let t = Table::new(rows, w)
        .header(header(&cols, s))
        .block(section(format!(" bdevs ({}) ", bdevs.len())));
    f.render_widget(t, a);
}

fn targets(f: &mut Frame, a: Rect, v: &View, s: &Screen) {
    let rows = v.targets.iter().map(|t| {
        Row::new(vec![
            t.name.clone(),
            t.connections.to_string(),
            opt(t.iops, 0),
            opt(t.mib_s, 1),
            t.errors.to_string(),
        ])
    });
    let w = [8, 7, 10, 9, 8].map(Constraint::Length);
    let cols = [
        ("target", None),
        ("conns", None),
        ("IOPS", None),
        ("MiB/s", None),
        ("errors", None),
    ];
    let t = Table::new(rows, w)
        .header(header(&cols, s))
        .block(section(" targets ".to_string()));
    f.render_widget(t, a);
}

fn conn_table(f: &mut Frame, a: Rect, conns: &[ConnRow], s: &Screen) {
    let rows = conns.iter().map(|c| {
        Row::new(vec![
            c.target.clone(),
            c.peer.clone(),
            c.queue.clone(),
            c.outstanding
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            opt(c.iops, 0),
            opt(c.pdus_per_s, 0),
        ])
    });
    let w = [
        Constraint::Length(6),
        Constraint::Min(20),
        Constraint::Length(16),
        Constraint::Length(6),
        Constraint::Length(9),
        Constraint::Length(9),
    ];
    let cols = [
        ("target", Some(SortKey::Name)),
        ("peer", None),
        ("queue", None),
        ("QD", Some(SortKey::QueueDepth)),
        ("IOPS", Some(SortKey::Iops)),
        ("PDU/s", None),
    ];
    let t = Table::new(rows, w)
        .header(header(&cols, s))
        .block(section(format!(" connections ({}) ", conns.len())));
    f.render_widget(t, a);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn row(name: &str, iops: f64, lat: f64) -> BdevRow {
        BdevRow {
            name: name.into(),
            read_iops: iops,
            write_iops: 0.0,
            iops,
            read_mib_s: iops / 256.0,
            write_mib_s: 0.0,
            avg_lat_us: lat,
            queue_depth: 1.0,
            num_read_ops: 0,
            num_write_ops: 0,
            bytes_read: 0,
            bytes_written: 0,
            errors: 0,
            read_p50_us: Some(lat),
            read_p99_us: Some(lat * 4.0),
            write_p50_us: None,
            write_p99_us: None,
        }
    }

    #[test]
    fn sort_keys_order_bdevs() {
        let mut v = vec![
            row("b", 10.0, 5.0),
            row("a", 30.0, 1.0),
            row("c", 20.0, 9.0),
        ];
        let names = |v: &[BdevRow]| v.iter().map(|b| b.name.clone()).collect::<String>();
        sort_bdevs(&mut v, SortKey::Iops, false);
        assert_eq!(names(&v), "acb");
        sort_bdevs(&mut v, SortKey::Latency, false);
        assert_eq!(names(&v), "cba");
        sort_bdevs(&mut v, SortKey::Name, false);
        assert_eq!(names(&v), "abc");
        sort_bdevs(&mut v, SortKey::Name, true);
        assert_eq!(names(&v), "cba");
        assert_eq!(action('q'), Action::Quit);
        assert_eq!(SortKey::QueueDepth.next(), SortKey::Name);
    }

    #[test]
    fn draws_in_80x24() {
        let view = View {
            interval_s: 1.0,
            reactors: vec![],
            bdevs: (0..40)
                .map(|i| row(&format!("Malloc{i}"), i as f64, 1.0))
                .collect(),
            targets: vec![],
            connections: vec![],
        };
        let s = Screen {
            sort: SortKey::Iops,
            reverse: false,
            interval_s: 1.0,
            socket: "/var/tmp/ustor.sock".into(),
            status: String::new(),
        };
        let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
        t.draw(|f| draw(f, Some(&view), &s)).unwrap();
        let text: String = t
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        // Busiest first, the key line kept on the last row.
        assert!(text.contains("Malloc39"), "{text}");
        // All columns fit: the percentiles and QD are on screen.
        assert!(text.contains("p99") && text.contains("QD"), "{text}");
        assert!(text.contains("IOPS*"));
        assert!(text.ends_with(&format!(
            "{:<80}",
            "q quit  s/n/i/b/l/d sort  r reverse  +/- interval"
        )));
    }
}
