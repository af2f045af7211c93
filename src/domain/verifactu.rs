//! VERI*FACTU's record fingerprint (the *huella*, AEAT "Especificaciones
//! técnicas para la generación de la huella o hash de los registros"):
//! SHA-256 over `campo=valor` pairs joined by `&` in a fixed order, UTF-8,
//! written as 64 uppercase hex digits. The previous record's huella is one
//! of the fields (empty for the first record of an issuer), which chains
//! the records. The hash is over the exact text of each value (`150` and
//! `150.00` differ), so callers keep the strings as they were sent.

use sha2::{Digest, Sha256};

/// A billing record (*registro de alta*).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alta<'a> {
    /// `IDEmisorFactura`: the issuer's NIF.
    pub issuer: &'a str,
    /// `NumSerieFactura`: the invoice's number and series.
    pub number: &'a str,
    /// `FechaExpedicionFactura`, `dd-mm-yyyy`.
    pub issued_on: &'a str,
    /// `TipoFactura` (`F1`, `F2`, `R1`, ...).
    pub invoice_type: &'a str,
    /// `CuotaTotal`, as sent.
    pub tax_total: &'a str,
    /// `ImporteTotal`, as sent.
    pub total: &'a str,
    /// `Huella` of the issuer's previous record; empty for the first.
    pub previous: &'a str,
    /// `FechaHoraHusoGenRegistro`: when the record was made, ISO 8601
    /// with its offset.
    pub generated_at: &'a str,
}

/// A cancellation record (*registro de anulación*): a new link of the
/// chain; the record it cancels and its number stay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anulacion<'a> {
    /// `IDEmisorFacturaAnulada`.
    pub issuer: &'a str,
    /// `NumSerieFacturaAnulada`.
    pub number: &'a str,
    /// `FechaExpedicionFacturaAnulada`, `dd-mm-yyyy`.
    pub issued_on: &'a str,
    /// `Huella` of the issuer's previous record.
    pub previous: &'a str,
    /// `FechaHoraHusoGenRegistro`.
    pub generated_at: &'a str,
}

impl Alta<'_> {
    /// The exact text the huella is computed over.
    pub fn chained_text(&self) -> String {
        joined(&[
            ("IDEmisorFactura", self.issuer),
            ("NumSerieFactura", self.number),
            ("FechaExpedicionFactura", self.issued_on),
            ("TipoFactura", self.invoice_type),
            ("CuotaTotal", self.tax_total),
            ("ImporteTotal", self.total),
            ("Huella", self.previous),
            ("FechaHoraHusoGenRegistro", self.generated_at),
        ])
    }

    pub fn huella(&self) -> String {
        huella_of(&self.chained_text())
    }
}

impl Anulacion<'_> {
    /// The exact text the huella is computed over.
    pub fn chained_text(&self) -> String {
        joined(&[
            ("IDEmisorFacturaAnulada", self.issuer),
            ("NumSerieFacturaAnulada", self.number),
            ("FechaExpedicionFacturaAnulada", self.issued_on),
            ("Huella", self.previous),
            ("FechaHoraHusoGenRegistro", self.generated_at),
        ])
    }

    pub fn huella(&self) -> String {
        huella_of(&self.chained_text())
    }
}

const ALTA_FIELDS: [&str; 8] = [
    "IDEmisorFactura",
    "NumSerieFactura",
    "FechaExpedicionFactura",
    "TipoFactura",
    "CuotaTotal",
    "ImporteTotal",
    "Huella",
    "FechaHoraHusoGenRegistro",
];
const ANULACION_FIELDS: [&str; 5] = [
    "IDEmisorFacturaAnulada",
    "NumSerieFacturaAnulada",
    "FechaExpedicionFacturaAnulada",
    "Huella",
    "FechaHoraHusoGenRegistro",
];

/// What a record's text says, read back: whether it is an alta, its
/// invoice number, and the huella it chains to. None when its fields are
/// not an alta's or an anulación's, in AEAT's order.
pub fn read_record(text: &str) -> Option<RecordRead<'_>> {
    let pairs: Vec<(&str, &str)> = text
        .split('&')
        .map(|pair| pair.split_once('='))
        .collect::<Option<_>>()?;
    let names: Vec<&str> = pairs.iter().map(|(n, _)| *n).collect();
    let alta = if names == ALTA_FIELDS {
        true
    } else if names == ANULACION_FIELDS {
        false
    } else {
        return None;
    };
    let value = |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    Some(RecordRead {
        alta,
        number: value(if alta {
            "NumSerieFactura"
        } else {
            "NumSerieFacturaAnulada"
        })?,
        previous: value("Huella")?,
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRead<'a> {
    pub alta: bool,
    pub number: &'a str,
    pub previous: &'a str,
}

/// A record's huella: SHA-256 of its exact text, 64 uppercase hex digits.
pub fn huella_of_text(text: &str) -> String {
    huella_of(text)
}

/// The invoice fields a VERI*FACTU document carries, as sent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Invoice {
    /// `FechaExpedicionFactura`: the date of issue, `dd-mm-yyyy`.
    #[schema(example = "01-01-2024", pattern = r"^\d{2}-\d{2}-\d{4}$")]
    pub date: String,
    /// `TipoFactura`: F1, F2, F3, R1, R2, R3, R4 or R5.
    #[serde(rename = "type")]
    #[schema(example = "F1")]
    pub invoice_type: String,
    /// `CuotaTotal`, kept exactly as sent (`150` and `150.00` hash apart).
    #[schema(example = "12.35", pattern = r"^-?\d{1,12}(\.\d{1,2})?$")]
    pub tax_total: String,
    /// `ImporteTotal`, kept exactly as sent.
    #[schema(example = "123.45", pattern = r"^-?\d{1,12}(\.\d{1,2})?$")]
    pub total: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvoiceError {
    #[error("invoice.date must be a date written dd-mm-yyyy, got {0:?}")]
    Date(String),
    #[error("invoice.type must be one of F1, F2, F3, R1, R2, R3, R4, R5, got {0:?}")]
    Type(String),
    #[error(
        "invoice.{0} must be an amount of up to 12 digits and 2 decimals (such as 123.45), got {1:?}"
    )]
    Amount(&'static str, String),
}

const INVOICE_TYPES: [&str; 8] = ["F1", "F2", "F3", "R1", "R2", "R3", "R4", "R5"];

fn is_amount(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let (whole, fraction) = match digits.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (digits, None),
    };
    (1..=12).contains(&whole.len())
        && whole.bytes().all(|b| b.is_ascii_digit())
        && fraction
            .is_none_or(|f| (1..=2).contains(&f.len()) && f.bytes().all(|b| b.is_ascii_digit()))
}

impl Invoice {
    pub fn check(&self) -> Result<(), InvoiceError> {
        let shape_ok = self.date.len() == 10
            && self.date.bytes().enumerate().all(|(i, b)| match i {
                2 | 5 => b == b'-',
                _ => b.is_ascii_digit(),
            });
        let date_ok = shape_ok
            && !self.date.ends_with("0000")
            && chrono::NaiveDate::parse_from_str(&self.date, "%d-%m-%Y").is_ok();
        if !date_ok {
            return Err(InvoiceError::Date(self.date.clone()));
        }
        if !INVOICE_TYPES.contains(&self.invoice_type.as_str()) {
            return Err(InvoiceError::Type(self.invoice_type.clone()));
        }
        if !is_amount(&self.tax_total) {
            return Err(InvoiceError::Amount("tax_total", self.tax_total.clone()));
        }
        if !is_amount(&self.total) {
            return Err(InvoiceError::Amount("total", self.total.clone()));
        }
        Ok(())
    }
}

/// AEAT's QR verification URL of an invoice (*ValidarQR*).
pub const QR_BASE: &str = "https://www2.agenciatributaria.gob.es/wlpl/TIKE-CONT/ValidarQR";

/// The invoice's ValidarQR URL: issuer, number, date of issue and total,
/// each percent-encoded as a query value.
pub fn qr_url(issuer: &str, number: &str, invoice: &Invoice) -> String {
    use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
    let value = |v: &str| utf8_percent_encode(v, NON_ALPHANUMERIC).to_string();
    format!(
        "{QR_BASE}?nif={}&numserie={}&fecha={}&importe={}",
        value(issuer),
        value(number),
        value(&invoice.date),
        value(&invoice.total)
    )
}

fn joined(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// SHA-256 of the text, 64 uppercase hex digits.
fn huella_of(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three examples AEAT publishes, chained: two altas of one issuer
    /// and the anulación of the second.
    #[test]
    fn aeat_examples_hash_byte_for_byte() {
        let first = Alta {
            issuer: "89890001K",
            number: "12345678/G33",
            issued_on: "01-01-2024",
            invoice_type: "F1",
            tax_total: "12.35",
            total: "123.45",
            previous: "",
            generated_at: "2024-01-01T19:20:30+01:00",
        };
        assert_eq!(
            first.chained_text(),
            "IDEmisorFactura=89890001K&NumSerieFactura=12345678/G33&FechaExpedicionFactura=01-01-2024\
             &TipoFactura=F1&CuotaTotal=12.35&ImporteTotal=123.45&Huella=\
             &FechaHoraHusoGenRegistro=2024-01-01T19:20:30+01:00"
        );
        let first_huella = first.huella();
        assert_eq!(
            first_huella,
            "3C464DAF61ACB827C65FDA19F352A4E3BDC2C640E9E9FC4CC058073F38F12F60"
        );
        let second = Alta {
            number: "12345679/G34",
            previous: &first_huella,
            generated_at: "2024-01-01T19:20:35+01:00",
            ..first.clone()
        };
        let second_huella = second.huella();
        assert_eq!(
            second_huella,
            "F7B94CFD8924EDFF273501B01EE5153E4CE8F259766F88CF6ACB8935802A2B97"
        );
        let cancelled = Anulacion {
            issuer: "89890001K",
            number: "12345679/G34",
            issued_on: "01-01-2024",
            previous: &second_huella,
            generated_at: "2024-01-01T19:20:40+01:00",
        };
        assert_eq!(
            cancelled.huella(),
            "177547C0D57AC74748561D054A9CEC14B4C4EA23D1BEFD6F2E69E3A388F90C68"
        );
    }

    #[test]
    fn records_read_back_and_invoices_are_checked() {
        let text = "IDEmisorFactura=89890001K&NumSerieFactura=12345678/G33&FechaExpedicionFactura=01-01-2024\
             &TipoFactura=F1&CuotaTotal=12.35&ImporteTotal=123.45&Huella=\
             &FechaHoraHusoGenRegistro=2024-01-01T19:20:30+01:00";
        assert_eq!(
            read_record(text),
            Some(RecordRead {
                alta: true,
                number: "12345678/G33",
                previous: ""
            })
        );
        assert_eq!(read_record(&text.replace("TipoFactura", "Tipo")), None);
        let invoice = Invoice {
            date: "31-12-2024".into(),
            invoice_type: "F1".into(),
            tax_total: "-1.5".into(),
            total: "150".into(),
        };
        assert_eq!(invoice.check(), Ok(()));
        for bad in [
            Invoice {
                date: "31-02-2024".into(),
                ..invoice.clone()
            },
            Invoice {
                date: "1-1-2024".into(),
                ..invoice.clone()
            },
            Invoice {
                invoice_type: "X1".into(),
                ..invoice.clone()
            },
            Invoice {
                total: "1.234".into(),
                ..invoice.clone()
            },
            Invoice {
                total: " 1".into(),
                ..invoice.clone()
            },
            Invoice {
                tax_total: "1e3".into(),
                ..invoice.clone()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert_eq!(
            qr_url("89890001K", "12345678/G33", &invoice),
            "https://www2.agenciatributaria.gob.es/wlpl/TIKE-CONT/ValidarQR?nif=89890001K\
             &numserie=12345678%2FG33&fecha=31%2D12%2D2024&importe=150"
        );
    }

    /// The hash is over the text as sent: the same amount written another
    /// way is another record.
    #[test]
    fn amounts_are_hashed_as_written() {
        let plain = Alta {
            issuer: "89890001K",
            number: "1",
            issued_on: "01-01-2024",
            invoice_type: "F1",
            tax_total: "150",
            total: "150",
            previous: "",
            generated_at: "2024-01-01T19:20:30+01:00",
        };
        let padded = Alta {
            total: "150.00",
            ..plain.clone()
        };
        assert_ne!(plain.huella(), padded.huella());
        assert_eq!(plain.huella().len(), 64);
        assert!(
            plain
                .huella()
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_lowercase())
        );
    }
}
