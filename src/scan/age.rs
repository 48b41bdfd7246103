//! Ages as kubectl shows them.

/// A duration as kubectl shows ages (apimachinery's `duration.HumanDuration`): about two
/// significant units, e.g. `70s`, `3m10s`, `70m`, `7h59m`, `47h`, `2d1h`, `367d`, `2y1d`;
/// `<invalid>` for more than a second in the future (a clock ahead).
pub fn human_duration(d: jiff::SignedDuration) -> String {
    let seconds = d.as_secs();
    if seconds < -1 {
        return "<invalid>".into();
    } else if seconds < 0 {
        return "0s".into();
    } else if seconds < 60 * 2 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        let s = seconds % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    } else if minutes < 60 * 3 {
        return format!("{minutes}m");
    }
    let hours = seconds / 3600;
    if hours < 8 {
        let m = minutes % 60;
        if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        }
    } else if hours < 48 {
        format!("{hours}h")
    } else if hours < 24 * 8 {
        let h = hours % 24;
        if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        }
    } else if hours < 24 * 365 * 2 {
        format!("{}d", hours / 24)
    } else if hours < 24 * 365 * 8 {
        let dy = (hours / 24) % 365;
        if dy == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{dy}d", hours / 24 / 365)
        }
    } else {
        format!("{}y", hours / 24 / 365)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ms: i64) -> jiff::SignedDuration {
        jiff::SignedDuration::from_millis(ms)
    }

    const S: i64 = 1_000;
    const M: i64 = 60 * S;
    const H: i64 = 60 * M;
    const DAY: i64 = 24 * H;
    const Y: i64 = 365 * DAY;

    /// apimachinery's TestHumanDuration and TestHumanDurationBoundaries, case by case.
    #[test]
    fn ages_read_as_kubectl_shows_them() {
        let cases = [
            (S, "1s"),
            (70 * S, "70s"),
            (190 * S, "3m10s"),
            (70 * M, "70m"),
            (47 * H, "47h"),
            (49 * H, "2d1h"),
            ((8 * 24 + 2) * H, "8d"),
            (367 * DAY, "367d"),
            ((365 * 2 * 24 + 25) * H, "2y1d"),
            ((365 * 8 * 24 + 2) * H, "8y"),
            (-2 * S, "<invalid>"),
            (-2 * S + 1, "0s"),
            (0, "0s"),
            (S - 1, "0s"),
            (2 * M - 1, "119s"),
            (2 * M, "2m"),
            (2 * M + S, "2m1s"),
            (10 * M - 1, "9m59s"),
            (10 * M, "10m"),
            (10 * M + S, "10m"),
            (3 * H - 1, "179m"),
            (3 * H, "3h"),
            (3 * H + M, "3h1m"),
            (8 * H - 1, "7h59m"),
            (8 * H, "8h"),
            (8 * H + 59 * M, "8h"),
            (2 * DAY - 1, "47h"),
            (2 * DAY, "2d"),
            (2 * DAY + H, "2d1h"),
            (8 * DAY - 1, "7d23h"),
            (8 * DAY, "8d"),
            (8 * DAY + 23 * H, "8d"),
            (2 * Y - 1, "729d"),
            (2 * Y, "2y"),
            (2 * Y + 23 * H, "2y"),
            (2 * Y + 23 * H + 59 * M, "2y"),
            (2 * Y + DAY - 1, "2y"),
            (2 * Y + DAY, "2y1d"),
            (3 * Y, "3y"),
            (7 * Y, "7y"),
            (8 * Y - 1, "7y364d"),
            (8 * Y, "8y"),
            (8 * Y + 364 * DAY, "8y"),
            (9 * Y, "9y"),
        ];
        for (ms, want) in cases {
            assert_eq!(human_duration(d(ms)), want, "{ms} ms");
        }
    }
}
