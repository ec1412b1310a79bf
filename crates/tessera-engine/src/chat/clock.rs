//! The clock behind `strftime_now`: civil dates from Unix time, formatted like C's `strftime`.

use std::time::{SystemTime, UNIX_EPOCH};

/// A calendar date and time of day, as `strftime_now` formats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilDateTime {
    pub year: i32,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl CivilDateTime {
    /// The time `secs` seconds after 1970-01-01 00:00:00 UTC.
    pub fn from_unix_seconds(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        CivilDateTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
        }
    }

    /// The current time in UTC (the system clock; tessera reads no time-zone database).
    pub fn now_utc() -> Self {
        let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_secs() as i64,
            Err(e) => -(e.duration().as_secs() as i64),
        };
        CivilDateTime::from_unix_seconds(secs)
    }

    /// Days since 1970-01-01.
    fn days(&self) -> i64 {
        days_from_civil(self.year, self.month, self.day)
    }

    /// 0 = Sunday … 6 = Saturday.
    fn weekday(&self) -> u32 {
        (self.days() + 4).rem_euclid(7) as u32
    }

    /// 1 = January 1st.
    fn day_of_year(&self) -> u32 {
        (self.days() - days_from_civil(self.year, 1, 1)) as u32 + 1
    }

    /// Formats like C's / Python's `strftime` in the C locale. Supported: `%a %A %b %B %c
    /// %C %d %D %e %F %h %H %I %j %m %M %n %p %R %S %t %T %u %w %x %X %y %Y %z %Z %%`, and
    /// the glibc flags `-` (no padding), `_` (pad with spaces), `0` (pad with zeros). `%z`
    /// and `%Z` are empty (a naive time, as Python's `datetime.now()`); anything else is
    /// copied as written.
    pub fn strftime(&self, fmt: &str) -> String {
        let mut out = String::with_capacity(fmt.len() + 16);
        let mut chars = fmt.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let flag = match chars.peek() {
                Some(&f @ ('-' | '_' | '0')) => {
                    chars.next();
                    Some(f)
                }
                _ => None,
            };
            let Some(spec) = chars.next() else {
                out.push('%');
                if let Some(f) = flag {
                    out.push(f);
                }
                break;
            };
            self.format_spec(&mut out, spec, flag);
        }
        out
    }

    fn format_spec(&self, out: &mut String, spec: char, flag: Option<char>) {
        const DAYS: [&str; 7] = [
            "Sunday",
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
        ];
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        let num = |out: &mut String, v: i64, width: usize, default_pad: char| {
            let pad = match flag {
                Some('-') => None,
                Some('_') => Some(' '),
                Some('0') => Some('0'),
                _ => Some(default_pad),
            };
            let digits = v.unsigned_abs().to_string();
            if v < 0 {
                out.push('-');
            }
            if let Some(p) = pad {
                for _ in digits.len()..width {
                    out.push(p);
                }
            }
            out.push_str(&digits);
        };
        let month_name = MONTHS[(self.month.clamp(1, 12) - 1) as usize];
        let day_name = DAYS[self.weekday() as usize];
        let hour12 = match self.hour % 12 {
            0 => 12,
            h => h,
        };
        match spec {
            'a' => out.push_str(&day_name[..3]),
            'A' => out.push_str(day_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'c' => {
                let s = self.strftime("%a %b %e %H:%M:%S %Y");
                out.push_str(&s);
            }
            'C' => num(out, self.year.div_euclid(100) as i64, 2, '0'),
            'd' => num(out, self.day as i64, 2, '0'),
            'D' | 'x' => out.push_str(&self.strftime("%m/%d/%y")),
            'e' => num(out, self.day as i64, 2, ' '),
            'F' => out.push_str(&self.strftime("%Y-%m-%d")),
            'H' => num(out, self.hour as i64, 2, '0'),
            'I' => num(out, hour12 as i64, 2, '0'),
            'j' => num(out, self.day_of_year() as i64, 3, '0'),
            'm' => num(out, self.month as i64, 2, '0'),
            'M' => num(out, self.minute as i64, 2, '0'),
            'n' => out.push('\n'),
            'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
            'R' => out.push_str(&self.strftime("%H:%M")),
            'S' => num(out, self.second as i64, 2, '0'),
            't' => out.push('\t'),
            'T' | 'X' => out.push_str(&self.strftime("%H:%M:%S")),
            'u' => num(out, [7, 1, 2, 3, 4, 5, 6][self.weekday() as usize], 1, '0'),
            'w' => num(out, self.weekday() as i64, 1, '0'),
            'y' => num(out, self.year.rem_euclid(100) as i64, 2, '0'),
            'Y' => num(out, self.year as i64, 1, '0'),
            'z' | 'Z' => {}
            '%' => out.push('%'),
            other => {
                out.push('%');
                if let Some(f) = flag {
                    out.push(f);
                }
                out.push(other);
            }
        }
    }
}

/// Howard Hinnant's `days_from_civil`: days since 1970-01-01 of a proleptic Gregorian date.
pub(super) fn days_from_civil(y: i32, m: u32, d: u32) -> i64 {
    let y = y as i64 - i64::from(m <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
pub(super) fn civil_from_days(z: i64) -> (i32, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y as i32, m, d)
}
